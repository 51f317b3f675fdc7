"""Warmup mode's KL pass alone: the dense kernel (flash_msa_rt.ops.warmup_kl) against the sparse KL pass over the
all-causal selection (sparse_fwd.msa_kl_cuda, what ran before it and still runs where the dense one is not built)
and cuDNN's dense causal forward, on the same inputs in one run. B*S = 128K tokens, bf16, D = Dp = 128.

FLOPs: 2*D*H*B*S*(S+1)/2 (the G main heads' scores) + 2*Dp*Hp*B*S*(S+1)/2 (the proxy's).
Usage: python benchmarks/bench_warmup_kl.py [--configs a,b,c] [--seqlens 8192,65536] [--out PATH]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.common import cuda_time_ms, write_results  # noqa: E402

FLOPS = "2*D*H*B*S*(S+1)/2 + 2*Dp*Hp*B*S*(S+1)/2"


def main(argv=None):
    from flash_msa_rt.ops import dense_main, sparse_fwd, warmup_kl
    from flash_msa_rt.ops.kernels import WARMUP_BLOCK, AllCausalBlocks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="a,b,c")
    p.add_argument("--seqlens", default="8192,65536")
    p.add_argument("--sparse", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the sparse KL pass (slow at long S)")
    p.add_argument("--out", default="warmup_kl")
    args = p.parse_args(argv)
    rows = []
    print(f"FLOPs = {FLOPS}")
    print(f"{'cfg':>3} {'S':>6} {'B':>2} {'dense KL ms':>11} {'TFLOP/s':>8} {'sparse KL ms':>12} {'speedup':>7} "
          f"{'cuDNN fwd ms':>12} {'KL/cuDNN':>8}")
    for cfg in args.configs.split(","):
        for S in (int(s) for s in args.seqlens.split(",")):
            x = random_problem(cfg, S)
            B, H, Hp, D, scale = x["B"], x["H"], x["Hp"], x["D"], x["scale"]
            qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
            flops = 2 * D * (H + Hp) * B * S * (S + 1) / 2
            _, lse = dense_main.dense_forward(q, k, v, scale)
            cudnn = cuda_time_ms(lambda: dense_main.dense_forward(q, k, v, scale), warmup=2, reps=5)
            row = dict(config=cfg, S=S, B=B, H=H, Hp=Hp, G=H // Hp, flops=flops, cudnn_fwd_ms=cudnn)
            why = warmup_kl.usable(qp, q)
            if why is None:
                dense = cuda_time_ms(lambda: warmup_kl.warmup_kl_cuda(qp, kp, q, k, lse, scale), warmup=2, reps=5)
                row.update(dense_kl_ms=dense, dense_kl_tflops=flops / dense / 1e9)
            else:
                row.update(dense_kl_ms=None, dense_kl_not_run=why)
            if args.sparse:
                sel = AllCausalBlocks(qp, WARMUP_BLOCK)
                sparse = cuda_time_ms(lambda: sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, WARMUP_BLOCK, scale),
                                      warmup=1, reps=3)
                row.update(sparse_kl_ms=sparse)
            rows.append(row)
            d, s = row.get("dense_kl_ms"), row.get("sparse_kl_ms")
            print(f"{cfg:>3} {S:>6} {B:>2} {d or float('nan'):11.2f} {flops / d / 1e9 if d else float('nan'):8.1f} "
                  f"{s or float('nan'):12.2f} {(s / d) if d and s else float('nan'):7.2f} {cudnn:12.2f} "
                  f"{(d / cudnn) if d else float('nan'):8.2f}", flush=True)
            del x, qp, kp, q, k, v, lse
            torch.cuda.empty_cache()
    write_results(args.out, dict(flops=FLOPS, rows=rows))


if __name__ == "__main__":
    main()
