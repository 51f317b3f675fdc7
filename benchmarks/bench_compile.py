"""One training step of flash_msa_func (forward + backward, loss = (out * g).sum() + kl_loss) eager, under
torch.compile (default) and under torch.compile(mode="reduce-overhead") (CUDA graph trees), against cuDNN's dense
causal attention (torch SDPA) eager and compiled, at configuration (a), B = 1 (issue 52).

Per mode: wall ms per step (host clock over back-to-back steps, synchronised at the end: what a training loop sees)
and device ms (CUDA events around one step), and the ratio of the two; the sparse step's speed-up over dense.

  python benchmarks/bench_compile.py [--seqlens 8192,16384,32768] [--kl-value deferred] [--out FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

try:  # run as a script (python benchmarks/bench_compile.py) or as a module
    from benchmarks.common import commit, cuda_time_ms, write_results
except ImportError:  # pragma: no cover
    from common import commit, cuda_time_ms, write_results

H, HK, HP, HPK, D, TOP_K = 16, 2, 4, 1, 128, 2048  # configuration (a)


def _inputs(S: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(h, d):
        return torch.randn(1, h, S, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()

    return [rnd(HP, D), rnd(HPK, D), rnd(H, D), rnd(HK, D), rnd(HK, D)]


def sparse_step(kl_value: str):
    import flash_msa_rt as F

    def step(qp, kp, q, k, v, g):
        out, kl = F.flash_msa_func(qp, kp, q, k, v, TOP_K, kl_value=kl_value)
        loss = (out.float() * g).sum() + kl
        loss.backward()
        return loss.detach()
    return step


def dense_step(qp, kp, q, k, v, g):
    rep = H // HK
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                           is_causal=True)
    loss = (out.transpose(1, 2).reshape(1, q.shape[2], H * D).float() * g).sum()
    loss.backward()
    return loss.detach()


def _timed(step, args, steps: int) -> tuple[float, float]:
    """(wall ms per step over `steps` back-to-back steps, device ms of one step by CUDA events)."""
    def one():
        for t in args[:5]:
            t.grad = None
        return step(*args)

    for _ in range(3):  # compile, record the graphs, warm the caches
        one()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    return wall, cuda_time_ms(one, warmup=1, reps=steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="8192,16384,32768")
    p.add_argument("--kl-value", default="deferred", choices=("exact", "deferred", "none"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for S in (int(s) for s in args.seqlens.split(",")):
        ins = _inputs(S)
        g = torch.randn(1, S, H * D, device="cuda")
        modes = {
            "sparse eager": sparse_step(args.kl_value),
            "sparse compiled": torch.compile(sparse_step(args.kl_value)),
            "sparse reduce-overhead": torch.compile(sparse_step(args.kl_value), mode="reduce-overhead"),
            "dense eager": dense_step,
            "dense compiled": torch.compile(dense_step),
        }
        row = {"S": S}
        for name, fn in modes.items():
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    wall, dev = _timed(fn, (*ins, g), args.steps)
                row[name] = {"wall_ms": round(wall, 3), "device_ms": round(dev, 3), "wall_over_device": round(wall / dev, 3)}
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            print(f"S={S:6d} {name:24s} {row[name]}", flush=True)
        best_dense = min((row[m]["wall_ms"] for m in ("dense eager", "dense compiled") if "wall_ms" in row[m]),
                         default=None)
        for m in ("sparse eager", "sparse compiled", "sparse reduce-overhead"):
            if best_dense and "wall_ms" in row[m]:
                row[m]["x_dense"] = round(best_dense / row[m]["wall_ms"], 3)
        rows.append(row)
    payload = {"what": "one training step (fwd + bwd) of flash_msa_func eager / compiled / reduce-overhead against "
                       "cuDNN dense causal attention (eager, compiled); x_dense = the faster dense wall time over the "
                       "sparse wall time", "commit": commit(), "device": torch.cuda.get_device_name(),
               "shape": {"config": "a", "B": 1, "H": H, "Hk": HK, "Hp": HP, "Hpk": HPK, "D": D, "top_k": TOP_K,
                         "kl_value": args.kl_value, "dtype": "bfloat16"},
               "rows": rows}
    path = write_results("compile", payload) if args.out is None else args.out
    if args.out is not None:
        import json
        args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
