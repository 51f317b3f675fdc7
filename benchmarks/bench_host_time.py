"""Host time of an eager flash_msa_func forward + backward on an idle device (issue 35, item 5: <= 0.5 ms at
configuration (a), B = 1, S = 8K).

Per kl_value mode and op path, the median over --reps steps of the CPU wall clock of issuing one step, the device
synchronised before it (so nothing waits on the device and the host's own time is measured): forward (flash_msa_func)
and backward (torch.autograd.grad with an upstream gradient and a KL coefficient) apart and together. Beside it:
  - the step's device time (CUDA events around one step, median) and steps back to back (the slower of the two);
  - the same work below the public API (select_blocks_cuda, msa_forward_cuda, msa_backward_cuda: no checks, no
    autograd), the runtime's own share;
  - per step: top-level torch ops of the forward and of the backward (profiler, CPU), kernel launches and
    packed-params misses (a miss packs params and may encode TMA descriptors: tens of us).
  - the floor of any eager autograd op: an empty torch.autograd.Function with the same inputs and outputs (its
    forward allocates the outputs, its backward the five gradients), issued the same way;
  - --against: the eager step under the defaults and under the given tuning overrides, interleaved round by round
    in one process (the host's speed drifts between runs by more than a policy changes it).
Paths: "eager" (the default path of an eager call, flash_msa_rt.ops.eager) and "custom_op" (the torch.library ops
that torch.compile sees, forced for the comparison by declaring the eager path unusable: a patch of this script's
own, restored after).

    FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python benchmarks/bench_host_time.py --out $OUT/host_time.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {"a": dict(H=16, Hk=2, Hp=4, Hpk=1)}  # docs/kernel-notes.md
D = 128
BLOCK = 128
TOP_K = 2048
TARGET_MS = 0.5


def make_problem(cfg: str, B: int, S: int, seed: int = 0) -> dict:
    c = CONFIGS[cfg]
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(heads):
        return torch.randn(B, S, heads, D, device="cuda", dtype=torch.bfloat16, generator=g)

    leaves = tuple(randn(h).requires_grad_() for h in (c["Hp"], c["Hpk"], c["H"], c["Hk"], c["Hk"]))
    dout = torch.randn(B, S, c["H"] * D, device="cuda", dtype=torch.bfloat16, generator=g)
    return dict(leaves=leaves, dout=dout, coef=torch.tensor(0.1, device="cuda"), scale=D ** -0.5, **c)


def api_step(x: dict, kl_value: str):
    """(forward, backward) of one public-API step; kl_value "deferred" writes the KL value into a device kl_metric."""
    from flash_msa_rt import flash_msa_func

    metric = torch.zeros((), device="cuda") if kl_value == "deferred" else None

    def forward():
        return flash_msa_func(*x["leaves"], top_k=TOP_K, layout="bshd", kl_value=kl_value, kl_metric=metric)

    def backward(out, kl):
        return torch.autograd.grad((out, kl), x["leaves"], (x["dout"], x["coef"]))

    return forward, backward


class _Empty(torch.autograd.Function):
    """flash_msa_func's inputs and outputs with no work: what torch's autograd costs an eager op by itself."""

    @staticmethod
    def forward(ctx, q_proxy, k_proxy, q, k, v):
        ctx.save_for_backward(q_proxy, k_proxy, q, k, v)
        return q.new_empty(q.shape[:2] + (q.shape[2] * q.shape[3],)), q.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out, grad_kl):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def empty_step(x: dict):
    """(forward, backward) of _Empty on the problem's leaves, as api_step's."""
    def backward(out, kl):
        return torch.autograd.grad((out, kl), x["leaves"], (x["dout"], x["coef"]))

    return lambda: _Empty.apply(*x["leaves"]), backward


def kernels_step(x: dict):
    """The same work below the public API: selection, forward (with the KL pass), backward."""
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    d = [t.detach() for t in x["leaves"]]
    B, S = d[2].shape[:2]
    go = x["dout"].view(d[2].shape)
    klg = torch.full((), 0.1 / (x["Hp"] * B * S), device="cuda")
    K = TOP_K // BLOCK

    def step():
        sel = select_blocks_cuda(d[0], d[1], K, BLOCK, x["scale"])
        out, lse, lse_p, _ = msa_forward_cuda(*d, sel, BLOCK, x["scale"])
        return msa_backward_cuda(*d, out, lse, lse_p, sel, BLOCK, x["scale"], go, klg)

    return step


@contextlib.contextmanager
def op_path(path: str):
    """path "custom_op": the eager fast path declared unusable (every call takes the torch.library ops)."""
    from flash_msa_rt.ops import eager

    usable = eager.usable
    if path == "custom_op":
        eager.usable = lambda *tensors: False
    try:
        yield
    finally:
        eager.usable = usable


def host_times(forward, backward, reps: int, warmup: int) -> dict:
    """Median host ms of forward, backward and both, each step starting on an idle device."""
    for _ in range(warmup):
        backward(*forward())
    torch.cuda.synchronize()
    fwd, bwd, both = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        backward(*out)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        both.append(t2 - t0)
        del out
    ms = lambda v: 1e3 * statistics.median(v)  # noqa: E731
    return dict(host_fwd_ms=ms(fwd), host_bwd_ms=ms(bwd), host_fwd_bwd_ms=ms(both),
                host_fwd_bwd_min_ms=1e3 * min(both))


def device_and_back_to_back(step, reps: int) -> dict:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return dict(device_ms=statistics.median(times), back_to_back_ms=1e3 * (time.perf_counter() - t0) / reps)


def counts(forward, backward) -> dict:
    """Top-level torch ops of one forward and one backward (profiler, CPU), and kernel launches and packed-params
    misses of one step (counters wrapped around the loader's driver call and its cache-miss path)."""
    from benchmarks.host_api_cpu import top_level_ops
    from flash_msa_rt import driver, loader

    result = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = forward()
    kinds, _ = top_level_ops(prof)
    result["torch_ops_fwd"] = dict(kinds, total=sum(kinds.values()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        backward(*out)
    kinds, _ = top_level_ops(prof)
    result["torch_ops_bwd"] = dict(kinds, total=sum(kinds.values()))
    del out
    torch.cuda.synchronize()

    launches, misses = Counter(), Counter()
    launch, prepare = driver.launch, loader.Kernel._prepare

    def counted_launch(cfg, func, address):
        launches["all"] += 1
        return launch(cfg, func, address)

    def counted_prepare(self, key, args):
        misses[self.entry.op] += 1
        return prepare(self, key, args)

    driver.launch, loader.Kernel._prepare = counted_launch, counted_prepare
    try:
        steps = 5
        for _ in range(steps):
            backward(*forward())
        torch.cuda.synchronize()
    finally:
        driver.launch, loader.Kernel._prepare = launch, prepare
    result["launches_per_step"] = launches["all"] / steps
    result["packed_misses_per_step"] = {op: n / steps for op, n in misses.items()}
    return result


def against_rounds(forward, backward, against: dict, rounds: int, reps: int, warmup: int) -> dict:
    """The step under the defaults and under the tuning overrides `against`, interleaved round by round in this
    process (the host's speed drifts between runs and machines by more than the differences measured): per
    setting, each round's median host ms of a forward + backward on an idle device and its median CUDA-event ms
    back to back with the L2 flushed between steps (bench_msa's timing), and the medians over the rounds."""
    from benchmarks.common import flushed_event_times
    from flash_msa_rt import tuning

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    settings = {"defaults": {}, "against": against}
    out = {name: {"host_fwd_bwd_ms": [], "step_ms": []} for name in settings}
    for _ in range(rounds):
        for name, overrides in settings.items():
            with tuning.override(**overrides):
                host = host_times(forward, backward, max(1, reps // rounds), warmup)
                step = flushed_event_times(lambda: backward(*forward()), max(1, reps // rounds), flush)
            out[name]["host_fwd_bwd_ms"].append(host["host_fwd_bwd_ms"])
            out[name]["step_ms"].append(statistics.median(step))
    for row in out.values():
        row.update({f"{k}_median": statistics.median(v) for k, v in list(row.items())})
    return dict(out, overrides=against, rounds=rounds)


def print_profile(forward, backward, reps: int, top: int = 45) -> None:
    """cProfile of reps steps (each on an idle device, as host_times), the functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(reps):
        torch.cuda.synchronize()
        prof.enable()
        backward(*forward())
        prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results path")
    p.add_argument("--config", default="a", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlens", default="8192")
    p.add_argument("--kl-values", default="deferred,exact")
    p.add_argument("--paths", default="eager,custom_op")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--against", type=json.loads, default=None,
                   help='tuning overrides (JSON: {"policy": {"field": value}}) to time the eager step under, '
                        'interleaved with the defaults over --rounds rounds')
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true",
                   help="also print a cProfile of --reps eager steps per kl_value, by own time (where the host goes)")
    args = p.parse_args(argv)

    results = dict(benchmark="host_time", target_ms=TARGET_MS, argv=sys.argv[1:], settings=vars(args),
                   method="host: CPU wall clock of issuing one step (flash_msa_func, then torch.autograd.grad) after "
                          "torch.cuda.synchronize(), median of --reps after --warmup; device: CUDA events around one "
                          "step, median; back_to_back: wall clock per step of --reps steps in a row",
                   torch=torch.__version__, python=platform.python_version(), rows=[], errors=[])
    try:
        from benchmarks.common import commit

        results["commit"] = commit()
        results["device"] = torch.cuda.get_device_name()
    except Exception as e:  # the measurement matters more than its label
        results["errors"].append(f"environment: {e!r}")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out_path.write_text(json.dumps(results, indent=1) + "\n")

    for S in (int(s) for s in args.seqlens.split(",")):
        x = make_problem(args.config, args.batch, S)
        try:
            step = kernels_step(x)
            row = dict(config=args.config, B=args.batch, S=S, level="kernels (below the API)",
                       **host_times(lambda: (), step, args.reps, args.warmup))
            row.update(device_and_back_to_back(step, args.reps))
            results["rows"].append(row)
            print(row, flush=True)
        except Exception:
            results["errors"].append(f"S={S} kernels: {traceback.format_exc()}")
            print(results["errors"][-1], flush=True)
        save()
        row = dict(config=args.config, B=args.batch, S=S, level="empty autograd.Function (the floor of an eager op)",
                   **host_times(*empty_step(x), args.reps, args.warmup))
        results["rows"].append(row)
        print(row, flush=True)
        for kl_value in args.kl_values.split(","):
            for path in args.paths.split(","):
                try:
                    forward, backward = api_step(x, kl_value)
                    with op_path(path):
                        row = dict(config=args.config, B=args.batch, S=S, level="flash_msa_func", kl_value=kl_value,
                                   path=path, **host_times(forward, backward, args.reps, args.warmup))
                        row.update(device_and_back_to_back(lambda: backward(*forward()), args.reps))
                        row.update(counts(forward, backward))
                    row["meets_target"] = row["host_fwd_bwd_ms"] <= TARGET_MS
                    if args.against and path == "eager":
                        with op_path(path):
                            row["against"] = against_rounds(forward, backward, args.against, args.rounds,
                                                            args.reps, args.warmup)
                    if args.profile and path == "eager":
                        with op_path(path):
                            print_profile(forward, backward, args.reps)
                    results["rows"].append(row)
                    print(row, flush=True)
                except Exception:
                    results["errors"].append(f"S={S} {kl_value} {path}: {traceback.format_exc()}")
                    print(results["errors"][-1], flush=True)
                save()
        del x
        torch.cuda.empty_cache()
    save()
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
