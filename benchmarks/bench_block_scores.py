"""proxy_block_scores (selection stage 1) speed against its floor.

FLOPs = 2 * Dp * Hp * B * S * (S + 1) / 2 (causal proxy QK, msa-semantics.md); bytes = the fp32 output
B * Hp * S * ceil(S / 128) * 4 plus the inputs. Floor = max(FLOPs / 770 TFLOP/s, bytes / 4 TB/s).
Run: FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_block_scores.py
"""

from __future__ import annotations

import torch

from benchmarks.common import PEAK_TBPS, PEAK_TFLOPS, cuda_time_ms, write_results
from flash_msa_rt import proxy_block_scores

SHAPES = [  # B, S, Hp, Hpk, Dp (MSA-like: 4 proxy heads sharing 1 proxy key head)
    (1, 4096, 4, 1, 128),
    (1, 8192, 4, 1, 128),
    (1, 16384, 4, 1, 128),
    (1, 32768, 4, 1, 128),
    (1, 65536, 4, 1, 128),
    (1, 16384, 4, 1, 64),
]


def main():
    rows = []
    print("FLOPs = 2*Dp*Hp*B*S*(S+1)/2; floor = max(FLOPs/770 TF/s, bytes/4 TB/s)")
    print(f"{'B':>2} {'S':>6} {'Hp':>3} {'Dp':>4} {'ms':>9} {'TFLOPS':>8} {'out GB/s':>9} {'floor ms':>9} {'of floor':>9}")
    for B, S, Hp, Hpk, Dp in SHAPES:
        q = torch.randn(B, S, Hp, Dp, device="cuda").to(torch.bfloat16)
        k = torch.randn(B, S, Hpk, Dp, device="cuda").to(torch.bfloat16)
        nb = -(-S // 128)
        out = torch.empty(B, Hp, S, nb, device="cuda")
        ms = cuda_time_ms(lambda: proxy_block_scores(q, k, out=out))
        flops = 2 * Dp * Hp * B * S * (S + 1) / 2
        nbytes = out.numel() * 4 + (q.numel() + k.numel()) * 2
        floor = max(flops / (PEAK_TFLOPS * 1e12), nbytes / (PEAK_TBPS * 1e12)) * 1e3
        row = dict(B=B, S=S, Hp=Hp, Hpk=Hpk, Dp=Dp, ms=ms, tflops=flops / ms / 1e9,
                   out_gbps=out.numel() * 4 / ms / 1e6, floor_ms=floor, fraction_of_floor=floor / ms)
        rows.append(row)
        print(f"{B:>2} {S:>6} {Hp:>3} {Dp:>4} {ms:>9.3f} {row['tflops']:>8.1f} {row['out_gbps']:>9.0f} "
              f"{floor:>9.3f} {row['fraction_of_floor']:>9.2f}")
        del q, k, out
    path = write_results("block_scores", {"formula": "2*Dp*Hp*B*S*(S+1)/2", "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
