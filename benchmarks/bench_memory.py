"""Peak GPU memory of flash_msa_func forward + backward against S (issue 36, item 4), beside dense attention's and
beside the peak predicted from the code (docs/memory.md).

Per S (default 8K .. 1M, doubling; configuration (b): H = 32, Hk = 8, Hp = 8, Hpk = 1, D = Dp = 128, top_k 2048,
block 128, bf16, B = 1), one shot each on fresh tensors:
  - flash_msa_func forward + torch.autograd.grad, kl_value "exact" and "deferred": torch.cuda.max_memory_allocated
    over the call, counting everything on the device (the inputs and dO included, as a training step holds them);
  - the same computation predicted without a GPU: the runtime's launchers run on fake CUDA tensors with the kernel
    launches left out, and every torch allocation they make is followed to its release (predict_peak);
  - dense causal attention (torch SDPA, cuDNN backend, else flash), forward + backward on the same q, k, v, dO;
    a row that does not fit says so (out of memory), as does one over --dense-max-seqlen.
Each row catches its own out-of-memory error and frees its tensors before the next; peak statistics are reset
between rows. Inputs are (B, S, heads, D) with layout="bshd", as benchmarks/bench_msa.py runs them.

    FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_memory.py \\
        --out benchmarks/results/memory.json --plot benchmarks/results/memory.png
    PYTHONPATH=. python3 benchmarks/bench_memory.py --predict-only --seqlens 1048576     # the model, on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
import weakref
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

CONFIGS = {"a": (16, 2, 4, 1), "b": (32, 8, 8, 1), "c": (64, 4, 4, 1)}  # name -> (H, Hk, Hp, Hpk), as bench_msa
D = DP = 128
BLOCK = 128
TOP_K = 2048
ARCH = "sm90a"
SEQLENS = [8192 << n for n in range(8)]  # 8K .. 1M
TARGET_GB = 64.0  # issue 36: peak at 1M tokens, configuration (b)
GB = 1e9


# --- the prediction: the runtime's allocations on fake tensors ---------------------------------------------------

class Allocations(TorchDispatchMode):
    """Follows every storage an op creates until it is freed (storages keep their Python object while alive, so a
    finalizer on it fires at the release): live bytes, the peak, and what was live at the peak, each allocation named
    by the innermost frame of flash_msa_rt (or this file) that made it. Caching-allocator rounding (512 bytes) is
    left out."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}
        self.bytes = self.peak = 0
        self.at_peak: list[tuple[int, str]] = []
        self.phase_peaks: dict[str, int] = {}
        self._phase_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t, func)
        return out

    def _track(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live or storage.nbytes() == 0:
            return
        n = storage.nbytes()
        self.live[key] = (n, f"{_where()} {func.__name__} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")
        weakref.finalize(storage, self._free, key)
        self.bytes += n
        self._phase_peak = max(self._phase_peak, self.bytes)
        if self.bytes > self.peak:
            self.peak = self.bytes
            self.at_peak = sorted(self.live.values(), reverse=True)

    def _free(self, key: int) -> None:
        n, _ = self.live.pop(key)
        self.bytes -= n

    def mark(self, phase: str) -> None:
        """Ends a phase: its peak is recorded, the next starts from the bytes live now."""
        self.phase_peaks[phase] = self._phase_peak
        self._phase_peak = self.bytes


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "flash_msa_rt" in frame.filename or frame.filename == __file__:
            return f"{Path(frame.filename).stem}.{frame.name}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def _without_launches():
    """The launchers with every kernel launch a no-op (the kernels allocate nothing; what they write is already
    allocated by the launchers), on fake CPU tensors that chunk_plans plans as CUDA tensors: its choice between the
    plan kernels and the torch sort (sparse_plan.lists_on_device) is made as on the device."""
    from flash_msa_rt.ops import sparse_bwd, sparse_fwd, sparse_plan

    def kernel(op, config, device):
        return lambda **args: None

    on_device = sparse_plan.lists_on_device

    def lists_on_device(block_indices, *args):  # reads .is_cuda and .shape only
        return on_device(SimpleNamespace(is_cuda=True, shape=block_indices.shape), *args)

    with contextlib.ExitStack() as stack:
        for module in (sparse_fwd, sparse_bwd):
            stack.enter_context(mock.patch.object(module, "get_kernel", kernel))
        stack.enter_context(mock.patch.object(sparse_plan, "lists_on_device", lists_on_device))
        stack.enter_context(mock.patch.object(sparse_plan, "_lists_kernels", lambda bs, K, dev: (
            kernel(None, None, None),) * 3))
        yield


def predict_peak(S: int, config: str = "b", kl_value: str = "exact", B: int = 1) -> dict:
    """The device bytes flash_msa_func forward + backward allocates at (config, S, B) in this harness (inputs and
    dO included), from the launchers themselves: sparse_fwd.msa_forward_cuda, msa_kl_cuda (deferred: the KL pass in
    the backward) and sparse_bwd.msa_backward_cuda on fake tensors, with the tensors autograd holds between them
    (the selection, out, lse, lse_proxy). Not modelled: torch.sort's internal scratch in the plans (the plan phase
    is not the peak: docs/memory.md) and the caching allocator's rounding.
    -> {"peak_bytes", "phases": {phase: peak bytes}, "at_peak": [[bytes, what], ...] largest first}."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_msa_rt.ops import sparse_bwd, sparse_fwd

    H, Hk, Hp, Hpk = CONFIGS[config]
    K, scale, bf16 = TOP_K // BLOCK, D ** -0.5, torch.bfloat16
    mem = Allocations()
    with FakeTensorMode(), _without_launches(), mem:
        empty = lambda *shape, dtype=bf16: torch.empty(*shape, dtype=dtype)  # noqa: E731
        qp, kp, q, k, v = (empty(B, S, h, d) for h, d in ((Hp, DP), (Hpk, DP), (H, D), (Hk, D), (Hk, D)))
        dout = empty(B, S, H, D)
        mem.mark("inputs")
        block_indices = empty(B, Hp, S, K, dtype=torch.int32)  # the selection kernel allocates its output only
        mem.mark("select")
        if kl_value == "exact":
            out, lse, lse_proxy, kl_rows = sparse_fwd.msa_forward_cuda(qp, kp, q, k, v, block_indices, BLOCK, scale,
                                                                       arch=ARCH)
        else:  # kernels._msa_forward with kl=False: the main attention, then zeros for lse_proxy and kl_rows
            out, lse, _, _ = sparse_fwd.msa_forward_cuda(None, None, q, k, v, block_indices, BLOCK, scale, arch=ARCH)
            lse_proxy, kl_rows = (torch.zeros(B, Hp, S) for _ in range(2))
        kl_loss = kl_rows.sum() / kl_rows.numel()
        del kl_rows
        mem.mark("forward")
        if kl_value == "deferred":  # the backward's KL pass (library._deferred_kl), before msa_backward
            lse_proxy_kl, kl_rows = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, block_indices, BLOCK, scale, arch=ARCH)
            kl_rows = kl_rows.sum() / kl_rows.numel()  # library._deferred_kl's value for kl_metric
            del kl_rows
            mem.mark("backward KL pass")
        else:
            lse_proxy_kl = lse_proxy
        kl_grad = torch.full((), 1.0 / (B * Hp * S)).expand(B, Hp, S)
        grads = sparse_bwd.msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_proxy_kl, block_indices, BLOCK, scale,
                                             dout, kl_grad, arch=ARCH)
        mem.mark("backward")
        del grads, kl_loss
    return {"peak_bytes": mem.peak, "phases": mem.phase_peaks, "at_peak": [[n, what] for n, what in mem.at_peak]}


def floor_bytes(S: int, config: str = "b", B: int = 1) -> int:
    """The op's inputs, out, dO and gradients (bf16): what forward + backward holds at the least."""
    H, Hk, Hp, Hpk = CONFIGS[config]
    inputs = 2 * B * S * (Hp * DP + Hpk * DP + H * D + 2 * Hk * D)
    return 2 * inputs + 2 * 2 * B * S * H * D


# --- the measurement -----------------------------------------------------------------------------------------------

def _fresh_inputs(S: int, config: str, B: int = 1, seed: int = 0):
    H, Hk, Hp, Hpk = CONFIGS[config]
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    tensors = [rnd(B, S, h, d).requires_grad_() for h, d in ((Hp, DP), (Hpk, DP), (H, D), (Hk, D), (Hk, D))]
    return tensors, rnd(B, S, H * D)


def _measured(fn) -> dict:
    """Peak of fn() on a clean slate: everything freed by the caller, peak statistics reset."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        fn()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as e:
        return dict(status=f"out of memory ({str(e).splitlines()[0][:160]})",
                    peak_bytes_before_oom=torch.cuda.max_memory_allocated())
    return dict(status="ok", peak_bytes=torch.cuda.max_memory_allocated(), allocated_before=before,
                peak_reserved_bytes=torch.cuda.max_memory_reserved(), seconds=time.perf_counter() - t0)


def measure_msa(S: int, config: str, kl_value: str) -> dict:
    from flash_msa_rt import flash_msa_func

    def run():
        (qp, kp, q, k, v), dout = _fresh_inputs(S, config)
        metric = torch.zeros((), device="cuda") if kl_value == "deferred" else None
        out, kl_loss = flash_msa_func(qp, kp, q, k, v, top_k=TOP_K, layout="bshd", kl_value=kl_value,
                                      kl_metric=metric)
        torch.autograd.grad((out, kl_loss), (qp, kp, q, k, v), (dout, torch.full((), 0.1, device="cuda")))

    return _measured(run)


def measure_dense(S: int, config: str) -> dict:
    """torch SDPA, causal, GQA, forward + backward on (B, H, S, D) views of the same (B, S, heads, D) tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = {}

    def run():
        (_, _, q, k, v), dout = _fresh_inputs(S, config)
        H = q.shape[2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for name, b in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(b):
                    out = sdpa(qt, kt, vt, is_causal=True, enable_gqa=True)
                    torch.autograd.grad(out, (q, k, v), dout.view(*q.shape[:2], H, D).transpose(1, 2))
                backend["name"] = name
                return
            except RuntimeError as e:
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                backend.setdefault("refused", []).append(f"{name}: {str(e).splitlines()[0][:160]}")
        raise RuntimeError(f"no SDPA backend ran: {backend['refused']}")

    try:
        row = _measured(run)
    except RuntimeError as e:
        row = dict(status=f"error: {str(e)[:300]}")
    return dict(row, **({"backend": backend["name"]} if "name" in backend else {}),
                **({"refused": backend["refused"]} if "refused" in backend else {}))


# --- the run -------------------------------------------------------------------------------------------------------

def run(args) -> dict:
    rows = []
    predict_cache = {}
    for S in args.seqlens:
        for kl_value in args.kl_values:
            pred = predict_cache.setdefault((S, kl_value), predict_peak(S, args.config, kl_value))
            row = dict(op="flash_msa_func", kl_value=kl_value, S=S, config=args.config,
                       predicted_peak_bytes=pred["peak_bytes"], predicted_phases=pred["phases"],
                       predicted_at_peak=pred["at_peak"][:12], floor_bytes=floor_bytes(S, args.config))
            if not args.predict_only:
                row.update(measure_msa(S, args.config, kl_value))
            rows.append(row)
            _say(row)
        if not args.predict_only:
            if S > args.dense_max_seqlen:
                row = dict(status=f"skipped: S > --dense-max-seqlen {args.dense_max_seqlen}")
            else:
                row = measure_dense(S, args.config)
            rows.append(dict(row, op="dense_sdpa", S=S, config=args.config, floor_bytes=_dense_floor(S, args.config)))
            _say(rows[-1])
    return rows


def _dense_floor(S: int, config: str, B: int = 1) -> int:
    """q, k, v, out, dO and dq, dk, dv in bf16."""
    H, Hk, _, _ = CONFIGS[config]
    return 2 * B * S * D * (2 * (H + 2 * Hk) + 2 * H)


def _say(row: dict) -> None:
    peak = row.get("peak_bytes")
    pred = row.get("predicted_peak_bytes")
    text = f"{row['op']:>15} {row.get('kl_value', ''):>8} S={row['S']:>8}: "
    text += f"peak {peak / GB:7.2f} GB" if peak is not None else f"{row.get('status', '')}"
    if pred is not None:
        text += f", predicted {pred / GB:7.2f} GB"
    text += f", floor {row['floor_bytes'] / GB:7.2f} GB"
    print(text, flush=True)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(8, 5))

    def series(op, key, kl_value=None):
        pts = [(r["S"], r[key] / GB) for r in rows if r["op"] == op and r.get(key) is not None
               and (kl_value is None or r.get("kl_value") == kl_value)]
        return zip(*pts) if pts else ((), ())

    for kl_value, color in (("exact", "tab:red"), ("deferred", "tab:orange")):
        ax.plot(*series("flash_msa_func", "peak_bytes", kl_value), marker="o", color=color,
                label=f"flash_msa_func fwd+bwd, kl_value={kl_value}")
        ax.plot(*series("flash_msa_func", "predicted_peak_bytes", kl_value), ls="--", color=color,
                label=f"predicted ({kl_value})")
    ax.plot(*series("flash_msa_func", "floor_bytes", "exact"), ls=":", color="gray",
            label="MSA inputs + out + dO + gradients")
    ax.plot(*series("dense_sdpa", "peak_bytes"), marker="s", color="black", label="dense SDPA fwd+bwd")
    missing = [r["S"] for r in rows if r["op"] == "dense_sdpa" and r.get("peak_bytes") is None]
    for S in missing:
        ax.annotate("dense: not run", (S, TARGET_GB), rotation=90, fontsize=7, ha="center")
    ax.axhline(TARGET_GB, color="tab:green", lw=0.8, label=f"target {TARGET_GB:g} GB at 1M")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("S (tokens, B = 1)")
    ax.set_ylabel("peak torch.cuda.max_memory_allocated (GB)")
    H, Hk, Hp, Hpk = CONFIGS[payload["config"]]
    ax.set_title(f"Peak memory, forward + backward, ({payload['config']}) H={H} Hk={Hk} Hp={Hp} Hpk={Hpk}, "
                 f"top_k {TOP_K}, bf16", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")], default=SEQLENS)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="b")
    ap.add_argument("--kl-values", type=lambda s: s.split(","), default=["exact", "deferred"])
    ap.add_argument("--dense-max-seqlen", type=int, default=1 << 20,
                    help="dense attention runs up to this S (one call at 1M takes ~58 s on the H200)")
    ap.add_argument("--predict-only", action="store_true", help="the model alone (no GPU needed)")
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    ap.add_argument("--plot", type=Path, default=None, help="PNG plot (matplotlib)")
    args = ap.parse_args(argv)
    for kl_value in args.kl_values:
        if kl_value not in ("exact", "deferred"):
            ap.error(f"--kl-values: {kl_value!r}; supported: exact, deferred")
    if not args.predict_only and not torch.cuda.is_available():
        ap.error("no CUDA device: pass --predict-only for the model alone")
    payload = dict(benchmark="bench_memory", argv=sys.argv[1:], config=args.config, top_k=TOP_K, block_size=BLOCK,
                   D=D, Dp=DP, B=1, dtype="bfloat16", layout="bshd", target_gb_at_1M=TARGET_GB,
                   method="peak = torch.cuda.max_memory_allocated over one forward + torch.autograd.grad on fresh "
                          "tensors (inputs and dO counted); predicted = predict_peak (the launchers on fake CUDA "
                          "tensors, kernel launches left out); floor = inputs + out + dO + gradients")
    if not args.predict_only:
        from benchmarks.common import commit

        payload.update(commit=commit(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                       alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    payload["rows"] = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    if args.plot:
        plot(payload, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
