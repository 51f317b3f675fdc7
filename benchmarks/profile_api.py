"""Where the public op's time goes: flash_msa_func + its backward (torch.autograd.grad, as bench_msa times it) under
torch.profiler, every CUDA kernel and memset by total device time over the profiled steps, with the custom ops'
own kernels and everything around them (layout copies, the KL mean, gradient casts) side by side.
Usage: python benchmarks/profile_api.py [cfg:S[:B] ...] [--steps N] [--set mod.ATTR=value,...]
(B * S = 128K tokens unless B is given; --set: runtime settings as benchmarks/ab_runtime.py takes them)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.ab_runtime import Applied, parse  # noqa: E402
from benchmarks.common import commit  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", default=["b:65536", "a:65536:1"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", default="base")
    args = ap.parse_args(argv)
    print(f"commit {commit()}, {torch.cuda.get_device_name()}, settings: {args.set}")
    with Applied(parse(args.set)):
        for spec in args.specs:
            profile(spec, args.steps)


def api_step(spec: str):
    """(problem, step) of "cfg:S[:B]" (B * S = 128K tokens unless B is given): step() is one flash_msa_func
    forward + torch.autograd.grad over the five inputs as leaves, as bench_msa times it."""
    from flash_msa_rt import flash_msa_func

    cfg, S, *batch = spec.split(":")
    x = random_problem(cfg, int(S), int(S) * int(batch[0]) if batch else 131072)
    B, S, H, D = x["B"], x["S"], x["H"], x["D"]
    leaves = [x[n].detach().requires_grad_() for n in ("qp", "kp", "q", "k", "v")]
    dout = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16)

    def step():
        out, kl = flash_msa_func(*leaves, top_k=2048, layout="bshd")
        return torch.autograd.grad((out, kl), leaves, (dout, torch.ones_like(kl)))

    return x, step


def profile(spec: str, steps: int):
    """Print the device time per step of one problem "cfg:S[:B]" and its 30 costliest kernels."""
    cfg = spec.split(":")[0]
    x, step = api_step(spec)
    B, S = x["B"], x["S"]
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / 1e3 / steps
    launches = sum(e.count for e in events) // steps
    print(f"\n=== {cfg} S={S} B={B}: {total:.2f} ms of device time per step in {launches} kernels")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:30]:
        print(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms  {e.count // steps:4d}x  {e.key[:110]}")


if __name__ == "__main__":
    main()
