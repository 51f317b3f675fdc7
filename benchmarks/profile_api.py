"""Where the public op's device time goes: flash_msa_func + its backward (torch.autograd.grad, as bench_msa times
it) under torch.profiler, every CUDA kernel and memset by total device time per step, the custom ops' own kernels
and everything around them (layout copies, the KL mean, gradient casts) side by side.
Usage: python benchmarks/profile_api.py [cfg:S[:B] ...] [--steps N] [--kl-value exact|deferred|none]
       [--select-precision bf16|fp8] [--tune JSON] [--out FILE]
(B * S = 128K tokens unless B is given; --tune: tuning overrides, e.g. '{"plan": {"keep_lists_entries": 0}}').
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.common import commit  # noqa: E402

TOP_K = 2048


def api_step(spec: str, kl_value: str = "exact", select_precision: str = "bf16"):
    """(problem, step) of "cfg:S[:B]" (B * S = 128K tokens unless B is given): step() is one flash_msa_func
    forward + torch.autograd.grad over the five inputs as leaves, as bench_msa times it ("deferred" writes the KL
    value into a device kl_metric)."""
    from flash_msa_rt import flash_msa_func

    cfg, S, *batch = spec.split(":")
    x = random_problem(cfg, int(S), int(S) * int(batch[0]) if batch else 131072)
    B, S, H, D = x["B"], x["S"], x["H"], x["D"]
    leaves = [x[n].detach().requires_grad_() for n in ("qp", "kp", "q", "k", "v")]
    dout = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16)
    metric = torch.zeros((), device="cuda") if kl_value == "deferred" else None

    def step():
        out, kl = flash_msa_func(*leaves, top_k=TOP_K, layout="bshd", kl_value=kl_value, kl_metric=metric,
                                 select_precision=select_precision)
        return torch.autograd.grad((out, kl), leaves, (dout, torch.ones_like(kl)))

    return x, step


def kernel_table(step, steps: int) -> dict:
    """Device ms per step of one problem's step() and its kernels by total device time (two untimed steps first)."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = sorted(((e.self_device_time_total / 1e3 / steps, e.count // steps, e.key) for e in events), reverse=True)
    return dict(device_ms=sum(r[0] for r in rows), launches=sum(r[1] for r in rows),
                kernels=[dict(ms=ms, count=n, name=name) for ms, n, name in rows])


def main(argv=None):
    from flash_msa_rt import tuning

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", default=["b:65536", "a:65536:1"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kl-value", default="exact", choices=("exact", "deferred", "none"))
    ap.add_argument("--select-precision", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--tune", type=json.loads, default=None, help="tuning overrides (JSON), as tuning.override")
    ap.add_argument("--top", type=int, default=30, help="kernels printed per problem")
    ap.add_argument("--out", type=Path, default=None, help="JSON of every problem's kernel table")
    a = ap.parse_args(argv)
    print(f"commit {commit()}, {torch.cuda.get_device_name()}, kl_value {a.kl_value}, "
          f"select_precision {a.select_precision}, tuning {a.tune or 'defaults'}")
    result = dict(commit=commit(), device=torch.cuda.get_device_name(), kl_value=a.kl_value,
                  select_precision=a.select_precision, tuning=a.tune, problems={})
    with tuning.override(**a.tune) if a.tune else contextlib.nullcontext():
        for spec in a.specs:
            x, step = api_step(spec, a.kl_value, a.select_precision)
            t = kernel_table(step, a.steps)
            print(f"\n=== {spec} (B={x['B']}): {t['device_ms']:.2f} ms of device time per step in {t['launches']} "
                  f"kernels", flush=True)
            for r in t["kernels"][:a.top]:
                print(f"  {r['ms']:8.3f} ms  {r['count']:4d}x  {r['name'][:110]}", flush=True)
            result["problems"][spec] = t
            del x, step
            torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
