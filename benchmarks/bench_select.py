"""MSA selection kernel (proxy QK + per-block max + top-K) speed against its floor and block_scores.

FLOPs = 2 * Dp * Hp * B * S * (S + 1) / 2 (causal proxy QK, msa-semantics.md). The issue's configurations: (a)
Hp=4, Hpk=1; (b) Hp=8, Hpk=1; (c) Hp=4, Hpk=1 (same proxy as (a)); Dp=128, bf16, top_k 2048 (K = 16),
B*S = 128K tokens. Target: >= 450 TFLOPS. block_scores (the same score tiles, every block score stored) runs
beside it on the same inputs: the difference is the cost of the top-K.
Run: FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_select.py
At key blocks of 64 (issue 53), the loop schedules side by side (top_k 2048 tokens: K = 32; "wide" is an opt-in
build, `build --set all --block-size 64`):
     python3 benchmarks/bench_select.py --block-size 64 --schedules block,wide --proxy-dims 64,128 --k-values 32
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import PEAK_TFLOPS, cuda_time_ms, write_results
from flash_msa_rt import proxy_block_scores, tuning
from flash_msa_rt.ops.select import select_blocks_cuda

TOKENS = 128 * 1024
LENGTHS = (8192, 16384, 32768, 65536, 131072)
PROXIES = {"a": (4, 1), "b": (8, 1)}  # (Hp, Hpk); (c) shares (a)'s proxy shape
K_VALUES = (16, 64)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--schedules", default="block", help="tuning.select block64_schedule values, at blocks of 64")
    ap.add_argument("--proxy-dims", default="128")
    ap.add_argument("--k-values", default=",".join(map(str, K_VALUES)))
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    a = ap.parse_args(argv)
    Bs = a.block_size
    schedules = a.schedules.split(",")
    rows = []
    print("FLOPs = 2*Dp*Hp*B*S*(S+1)/2; floor = FLOPs / 770 TF/s; block_scores stores every block score")
    print(f"{'cfg':>4} {'B':>3} {'S':>7} {'Hp':>3} {'Dp':>3} {'K':>3} {'schedule':>8} {'select ms':>10} {'TFLOPS':>7} "
          f"{'of floor':>8} {'scores ms':>10} {'TFLOPS':>7}")
    for cfg, (Hp, Hpk) in PROXIES.items():
        for Dp in (int(d) for d in a.proxy_dims.split(",")):
            for S in (int(x) for x in a.lengths.split(",")):
                B = max(1, TOKENS // S)
                q = torch.randn(B, S, Hp, Dp, device="cuda").to(torch.bfloat16)
                k = torch.randn(B, S, Hpk, Dp, device="cuda").to(torch.bfloat16)
                flops = 2 * Dp * Hp * B * S * (S + 1) / 2
                floor_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3
                scores_ms = None
                if B * Hp * S * (S // Bs) * 4 <= 8 << 30:  # the full score matrix, where it fits comfortably
                    scores_ms = cuda_time_ms(lambda: proxy_block_scores(q, k, block_size=Bs))
                for K in (int(x) for x in a.k_values.split(",")):
                    for schedule in schedules:
                        with tuning.override(select={"block64_schedule": schedule}):
                            ms = cuda_time_ms(lambda: select_blocks_cuda(q, k, K, Bs, Dp ** -0.5))
                        row = dict(config=cfg, B=B, S=S, Hp=Hp, Hpk=Hpk, Dp=Dp, K=K, block_size=Bs, schedule=schedule,
                                   ms=ms, tflops=flops / ms / 1e9, floor_ms=floor_ms,
                                   fraction_of_floor=floor_ms / ms, block_scores_ms=scores_ms,
                                   block_scores_tflops=flops / scores_ms / 1e9 if scores_ms else None)
                        rows.append(row)
                        sc = (f"{scores_ms:>10.3f} {row['block_scores_tflops']:>7.1f}" if scores_ms
                              else f"{'-':>10} {'-':>7}")
                        print(f"{cfg:>4} {B:>3} {S:>7} {Hp:>3} {Dp:>3} {K:>3} {schedule:>8} {ms:>10.3f} "
                              f"{row['tflops']:>7.1f} {row['fraction_of_floor']:>8.2f} {sc}")
                del q, k
                torch.cuda.empty_cache()
    name = "select" if Bs == 128 and schedules == ["block"] else f"select_b{Bs}"
    path = write_results(name, {"formula": "2*Dp*Hp*B*S*(S+1)/2", "argv": sys.argv[1:] if argv is None else argv,
                                     "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
