"""Where one training step of MiniMax-M3's attention block spends its device time: the step of
bench_transformers_m3.py (projections, norms, RoPE, indexer, attention; forward + backward) under torch.profiler,
its kernels grouped into families by name and listed by total device time.

    python benchmarks/profile_m3.py [--seqlen 65536] [--methods msa,dense_sdpa] [--top 25] [--out FILE]

--out writes {method: {"total_ms", "families": {family: ms}, "kernels": [[name, ms, calls], ...]}} as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_transformers_m3 import build, step_fn  # noqa: E402
from benchmarks.common import commit  # noqa: E402

# (family, pattern over the kernel name): the first match names a kernel's family
FAMILIES = (
    ("flash_msa", r"sparse_|select|block_scores|plan_|bwd_delta|slot_sum|grad_cast|warmup_|fp8_quant|kl_"),
    ("attention (cuDNN / flash)", r"cudnn|fmha|flash|sdpa|attention"),
    ("gemm", r"gemm|nvjet|cutlass|sm90_xmma|wgmma|Kernel2"),
    ("reduction", r"reduce|norm"),
    ("copy / cat / index", r"copy|cat|index|gather|scatter|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
)


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def kernel_times(step, steps: int = 2) -> tuple[dict, list]:
    """({kernel name: [total ms per step, calls per step]}, [[idle ms, kernel before, kernel after], ...]) over
    `steps` profiled steps after one warm step; the second lists every stretch over 50 us in which no kernel ran
    (host-bound spans: a sync, or the host enqueueing slower than the device runs), longest first."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals = defaultdict(lambda: [0.0, 0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = totals[e.name]
            t[0] += e.device_time_total / 1e3 / steps
            t[1] += 1
            spans.append((e.time_range.start, e.time_range.end, e.name))
    spans.sort()
    gaps, reach, last = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start - reach > 50:
            gaps.append([(start - reach) / 1e3, last[:90], name[:90]])
        if end > reach:
            reach, last = end, name
    return {k: [v[0], v[1] // steps] for k, v in totals.items()}, sorted(gaps, reverse=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--methods", default="msa,dense_sdpa")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    result = {"seqlen": args.seqlen, "commit": commit(), "device": torch.cuda.get_device_name()}
    for method in args.methods.split(","):
        block, rotary, handle = build(method)
        step = step_fn(block, rotary, handle, args.seqlen)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
            kernels, gaps = kernel_times(step)
        total = sum(v[0] for v in kernels.values())
        families = defaultdict(float)
        for name, (ms, _) in kernels.items():
            families[family(name)] += ms
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
        print(f"\n== {method} S={args.seqlen}: {total:.1f} ms of kernels per step ({result['device']})")
        for fam, ms in sorted(families.items(), key=lambda kv: -kv[1]):
            print(f"  {fam:28s} {ms:8.2f} ms")
        for name, (ms, calls) in ranked[:args.top]:
            print(f"  {ms:8.2f} ms {calls:4d}x  {name[:150]}")
        idle = sum(g[0] for g in gaps) / 2
        print(f"  idle stretches over 50 us: {idle:.2f} ms per step; longest:")
        for ms, before, after in gaps[:10]:
            print(f"    {ms:7.2f} ms after {before} / before {after}")
        result[method] = {"total_ms": total, "families": dict(families), "idle_ms": idle, "gaps": gaps[:40],
                          "kernels": [[n, ms, c] for n, (ms, c) in ranked]}
        del block, rotary, handle, step
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
