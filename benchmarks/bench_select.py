"""MSA selection kernel (proxy QK + per-block max + top-K) speed against its floor and block_scores.

FLOPs = 2 * Dp * Hp * B * S * (S + 1) / 2 (causal proxy QK, msa-semantics.md). The issue's configurations: (a)
Hp=4, Hpk=1; (b) Hp=8, Hpk=1; (c) Hp=4, Hpk=1 (same proxy as (a)); Dp=128, bf16, top_k 2048 (K = 16),
B*S = 128K tokens. Target: >= 450 TFLOPS. block_scores (the same score tiles, every block score stored) runs
beside it on the same inputs: the difference is the cost of the top-K.
Run: FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_select.py
"""

from __future__ import annotations

import torch

from benchmarks.common import PEAK_TFLOPS, cuda_time_ms, write_results
from flash_msa_rt import proxy_block_scores
from flash_msa_rt.ops.select import select_blocks_cuda

TOKENS = 128 * 1024
LENGTHS = (8192, 16384, 32768, 65536, 131072)
PROXIES = {"a": (4, 1), "b": (8, 1)}  # (Hp, Hpk); (c) shares (a)'s proxy shape
K_VALUES = (16, 64)


def main():
    rows = []
    print("FLOPs = 2*Dp*Hp*B*S*(S+1)/2; floor = FLOPs / 770 TF/s; block_scores stores every block score")
    print(f"{'cfg':>4} {'B':>3} {'S':>7} {'Hp':>3} {'K':>3} {'select ms':>10} {'TFLOPS':>7} {'of floor':>8} "
          f"{'scores ms':>10} {'TFLOPS':>7}")
    for cfg, (Hp, Hpk) in PROXIES.items():
        for S in LENGTHS:
            B = max(1, TOKENS // S)
            q = torch.randn(B, S, Hp, 128, device="cuda").to(torch.bfloat16)
            k = torch.randn(B, S, Hpk, 128, device="cuda").to(torch.bfloat16)
            flops = 2 * 128 * Hp * B * S * (S + 1) / 2
            floor_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3
            scores_ms = None
            if B * Hp * S * (S // 128) * 4 <= 8 << 30:  # the full score matrix, where it fits comfortably
                scores_ms = cuda_time_ms(lambda: proxy_block_scores(q, k))
            for K in K_VALUES:
                ms = cuda_time_ms(lambda: select_blocks_cuda(q, k, K, 128, 128 ** -0.5))
                row = dict(config=cfg, B=B, S=S, Hp=Hp, Hpk=Hpk, Dp=128, K=K, ms=ms, tflops=flops / ms / 1e9,
                           floor_ms=floor_ms, fraction_of_floor=floor_ms / ms, block_scores_ms=scores_ms,
                           block_scores_tflops=flops / scores_ms / 1e9 if scores_ms else None)
                rows.append(row)
                sc = f"{scores_ms:>10.3f} {row['block_scores_tflops']:>7.1f}" if scores_ms else f"{'-':>10} {'-':>7}"
                print(f"{cfg:>4} {B:>3} {S:>7} {Hp:>3} {K:>3} {ms:>10.3f} {row['tflops']:>7.1f} "
                      f"{row['fraction_of_floor']:>8.2f} {sc}")
            del q, k
            torch.cuda.empty_cache()
    path = write_results("select", {"formula": "2*Dp*Hp*B*S*(S+1)/2", "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
