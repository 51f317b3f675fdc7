"""Warmup mode's proxy kernels alone: the dense KL pass and proxy backward (flash_msa_rt.ops.warmup_kl) against
the sparse kernels over the all-causal selection (sparse_fwd.msa_kl_cuda, sparse_bwd.proxy_backward_cuda: what ran
before them and still runs where they are not built) and cuDNN's dense causal forward and backward, on the same
inputs in one run. B*S = 128K tokens, bf16, D = Dp = 128.

FLOPs per causal (b, p, i, t <= i) pair: KL pass 2*(D*G + Dp) (the G heads' scores and the proxy's), proxy
backward 2*(D*G + 3*Dp) (plus dq_p and dk_p), the proxy lse alone 2*Dp (deferred KL mode's forward part; the
proxy backward's kl_value variant, which also forms the KL value, is timed beside the plain one with the same
formula); totals over B*Hp*S*(S+1)/2 pairs. Useful FLOPs only: at G = 8 and
16 the proxy backward runs in chunks of 4 heads, each recomputing the proxy's products, which are not counted.
Usage: python benchmarks/bench_warmup_kl.py [--configs a,b,c] [--seqlens 8192,65536] [--no-sparse] [--out NAME]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.common import cuda_time_ms, write_results  # noqa: E402

FLOPS = {"kl": "2*(D*H + Dp*Hp)*B*S*(S+1)/2", "proxy_bwd": "2*(D*H + 3*Dp*Hp)*B*S*(S+1)/2",
         "lse": "2*Dp*Hp*B*S*(S+1)/2", "proxy_bwd_kl": "2*(D*H + 3*Dp*Hp)*B*S*(S+1)/2"}


def main(argv=None):
    from flash_msa_rt.ops import dense_main, sparse_bwd, sparse_fwd, warmup_kl
    from flash_msa_rt.ops.kernels import WARMUP_BLOCK, AllCausalBlocks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="a,b,c")
    p.add_argument("--seqlens", default="8192,65536")
    p.add_argument("--sparse", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the sparse kernels over the all-causal selection (slow at long S)")
    p.add_argument("--out", default="warmup_kl")
    args = p.parse_args(argv)
    rows = []
    print(f"FLOPs: KL pass {FLOPS['kl']}, proxy backward {FLOPS['proxy_bwd']}")
    print(f"{'cfg':>3} {'S':>6} {'B':>2} | {'KL ms':>7} {'TFLOP/s':>7} {'sparse':>7} {'cuDNN fwd':>9} | "
          f"{'bwd ms':>7} {'TFLOP/s':>7} {'sparse':>7} {'cuDNN bwd':>9}")
    nan = float("nan")
    for cfg in args.configs.split(","):
        for S in (int(s) for s in args.seqlens.split(",")):
            x = random_problem(cfg, S)
            B, H, Hp, D, scale = x["B"], x["H"], x["Hp"], x["D"], x["scale"]
            qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
            pairs = B * S * (S + 1) / 2
            flops = {"kl": 2 * D * (H + Hp) * pairs, "proxy_bwd": 2 * D * (H + 3 * Hp) * pairs,
                     "lse": 2 * D * Hp * pairs, "proxy_bwd_kl": 2 * D * (H + 3 * Hp) * pairs}
            kl_rows = torch.empty((B, Hp, S), device=q.device)
            out, lse = dense_main.dense_forward(q, k, v, scale)
            go = torch.randn_like(q)
            klg = torch.full((B, Hp, S), 1.0 / (B * Hp * S), device=q.device)
            row = dict(config=cfg, S=S, B=B, H=H, Hp=Hp, G=H // Hp, flops=flops,
                       cudnn_fwd_ms=cuda_time_ms(lambda: dense_main.dense_forward(q, k, v, scale), warmup=2, reps=5),
                       cudnn_bwd_ms=cuda_time_ms(lambda: dense_main.dense_backward(q, k, v, out, lse, go, scale),
                                                 warmup=1, reps=3))
            sel = AllCausalBlocks(qp, WARMUP_BLOCK)
            lse_p = (warmup_kl.warmup_kl_cuda(qp, kp, q, k, lse, scale) if warmup_kl.usable(qp, q) is None
                     else sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, WARMUP_BLOCK, scale))[0]
            ops = {"kl": "warmup_kl", "proxy_bwd": "warmup_bwd_proxy", "lse": "warmup_lse",
                   "proxy_bwd_kl": "warmup_bwd_proxy_kl"}
            for name, fn in (("kl", lambda: warmup_kl.warmup_kl_cuda(qp, kp, q, k, lse, scale)),
                             ("proxy_bwd", lambda: warmup_kl.warmup_proxy_backward_cuda(qp, kp, q, k, lse, lse_p,
                                                                                         scale, klg)),
                             ("lse", lambda: warmup_kl.warmup_lse_cuda(qp, kp, scale)),
                             ("proxy_bwd_kl", lambda: warmup_kl.warmup_proxy_backward_cuda(
                                 qp, kp, q, k, lse, lse_p, scale, klg, kl_rows))):
                op = ops[name]
                why = warmup_kl.usable(qp, q, op)
                if why is None:
                    t = cuda_time_ms(fn, warmup=2, reps=5)
                    row.update({f"dense_{name}_ms": t, f"dense_{name}_tflops": flops[name] / t / 1e9})
                else:
                    # the reason's first clause: the loader's message goes on with this machine's artifact path
                    row.update({f"dense_{name}_ms": None, f"dense_{name}_not_run": why.split(" (variant")[0]})
            if args.sparse:
                row["sparse_kl_ms"] = cuda_time_ms(
                    lambda: sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, WARMUP_BLOCK, scale), warmup=1, reps=3)
                row["sparse_proxy_bwd_ms"] = cuda_time_ms(
                    lambda: sparse_bwd.proxy_backward_cuda(qp, kp, q, k, lse, lse_p, sel, WARMUP_BLOCK, scale, klg),
                    warmup=1, reps=3)
            rows.append(row)
            g = row.get
            dk, db = g("dense_kl_ms"), g("dense_proxy_bwd_ms")
            print(f"{cfg:>3} {S:>6} {B:>2} | {dk or nan:7.2f} {g('dense_kl_tflops') or nan:7.1f} "
                  f"{g('sparse_kl_ms') or nan:7.2f} {row['cudnn_fwd_ms']:9.2f} | {db or nan:7.2f} "
                  f"{g('dense_proxy_bwd_tflops') or nan:7.1f} {g('sparse_proxy_bwd_ms') or nan:7.2f} "
                  f"{row['cudnn_bwd_ms']:9.2f} | lse alone {g('dense_lse_ms') or nan:7.2f} ms "
                  f"({g('dense_lse_tflops') or nan:.0f} TFLOP/s), bwd with the KL value {g('dense_proxy_bwd_kl_ms') or nan:7.2f}",
                  flush=True)
            del x, qp, kp, q, k, v, lse, out, go
            torch.cuda.empty_cache()
    write_results(args.out, dict(flops=FLOPS, rows=rows))


if __name__ == "__main__":
    main()
