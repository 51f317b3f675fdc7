"""Where fp8 selection's quantisation pass spends its time: torch.profiler's kernel table for quantize_rows
(q_proxy) and quantize_key_blocks (k_proxy) at (b), B = 1, S = 128K, then alternative formulations of the row
pass timed and checked byte for byte against quantize_rows (a faster one that is not byte-equal is no candidate).

Run: FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/profile_fp8_quant.py --out quant.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import commit, cuda_time_ms
from flash_msa_rt.reference import fp8


def _scale_of(amax):
    return fp8.power_of_two_scale(amax)


def rows_view_aminmax(x):
    D = x.shape[-1]
    lo, hi = torch.aminmax(x.view(-1, D), dim=1)
    s = _scale_of(fp8._abs_max(lo, hi))
    return (x.view(-1, D) * (1.0 / s).to(x.dtype).unsqueeze(1)).to(fp8.E4M3).view(x.shape)


def rows_abs_amax(x):
    D = x.shape[-1]
    s = _scale_of(x.view(-1, D).abs().amax(dim=1))
    return (x.view(-1, D) * (1.0 / s).to(x.dtype).unsqueeze(1)).to(fp8.E4M3).view(x.shape)


def rows_float_mul(x):
    D = x.shape[-1]
    lo, hi = torch.aminmax(x.view(-1, D), dim=1)
    s = _scale_of(fp8._abs_max(lo, hi))
    return (x.view(-1, D).float() * (1.0 / s).unsqueeze(1)).to(fp8.E4M3).view(x.shape)


def rows_expand_mul(x):
    """The multiplier expanded to a full bf16 tensor first (a contiguous mul, vectorised)."""
    D = x.shape[-1]
    lo, hi = torch.aminmax(x.view(-1, D), dim=1)
    s = _scale_of(fp8._abs_max(lo, hi))
    inv = (1.0 / s).to(x.dtype).unsqueeze(1).expand(-1, D).contiguous()
    return (x.view(-1, D) * inv).to(fp8.E4M3).view(x.shape)


def kernel_table(fn, rows=12):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=131072)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    S = args.seqlen
    q = torch.randn(1, S, 8, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(1, S, 1, 128, device="cuda").to(torch.bfloat16)
    print(f"(b) B = 1, S = {S}: q_proxy {tuple(q.shape)}, k_proxy {tuple(k.shape)}, bf16")
    tables = {"quantize_rows": kernel_table(lambda: fp8.quantize_rows(q)),
              "quantize_key_blocks": kernel_table(lambda: fp8.quantize_key_blocks(k, 128))}
    for name, table in tables.items():
        print(f"\n{name} (5 calls):\n{table}")
    want = fp8.quantize_rows(q)[0].view(torch.uint8)
    rows = {"quantize_rows": cuda_time_ms(lambda: fp8.quantize_rows(q)),
            "quantize_key_blocks": cuda_time_ms(lambda: fp8.quantize_key_blocks(k, 128))}
    equal = {}
    for fn in (rows_view_aminmax, rows_abs_amax, rows_float_mul, rows_expand_mul):
        equal[fn.__name__] = bool(torch.equal(fn(q).view(torch.uint8), want))
        rows[fn.__name__] = cuda_time_ms(lambda: fn(q))
    floor = 3 * q.numel() * 2 / 4e12 * 1e3  # read twice, e4m3 written: ~3 bf16-sized passes at 4 TB/s
    print("\nms: " + ", ".join(f"{n} {v:.3f}" for n, v in rows.items()) + f"; floor of the row pass {floor:.3f}")
    print("byte-equal to quantize_rows: " + ", ".join(f"{n} {v}" for n, v in equal.items()))
    args.out.write_text(json.dumps({"benchmark": "profile_fp8_quant", "commit": commit(), "S": S, "ms": rows,
                                    "byte_equal": equal, "row_pass_floor_ms": floor, "tables": tables},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
