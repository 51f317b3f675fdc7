"""fp8 selection's parts on the GPU: the quantisation pass (q_proxy per row, k_proxy per key block) and the e4m3
selection kernel alone (one key block per loop step, and the opt-in two-block "pairs" build), beside the bf16
kernel, at 128K tokens per step in (a) and (b) and at B = 1 up to `--long`.

Selection FLOPs = 2 * Dp * Hp * B * S * (S + 1) / 2 (msa-semantics.md). The quantisation's floor: q_proxy read
twice (min/max, then the multiply) and written once as e4m3, k_proxy likewise, at 4 TB/s. Also times the
alternative multiply that stores e4m3 directly (torch.mul(..., out=e4m3)), which the runtime does not use.
Run: FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_fp8_select.py --out fp8_select.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import PEAK_TBPS, commit, cuda_time_ms
from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops import select
from flash_msa_rt.reference import fp8

PROXIES = {"a": (4, 1), "b": (8, 1)}  # (Hp, Hpk), Dp = 128


def direct_store(x: torch.Tensor) -> torch.Tensor:
    """quantize_rows with the multiply storing e4m3 itself (one op, converting inside it)."""
    scale = fp8.power_of_two_scale(fp8._abs_max(*torch.aminmax(x, dim=-1)))
    out = torch.empty(x.shape, dtype=fp8.E4M3, device=x.device)
    return torch.mul(x, (1.0 / scale).unsqueeze(-1), out=out)


def kernel_alone(q8, k8, k_scale, out, K, schedule="block"):
    Hp, Hpk = q8.shape[2], k8.shape[2]
    config = select.kernel_config("e4m3", 128, 128, select.max_k_for(K, "sm90a"), "wgmma", schedule)
    kernel = get_kernel("select", config, q8.device)
    return lambda: kernel(q_proxy=q8, k_proxy=k8, block_indices=out, k_scale=k_scale, scale=0.09, group=Hp // Hpk)


def row(cfg, B, S, Hp, Hpk, K=16):
    reps = dict(warmup=1, reps=3) if S >= 262144 else {}  # a 1M selection takes about a second
    q = torch.randn(B, S, Hp, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(B, S, Hpk, 128, device="cuda").to(torch.bfloat16)
    flops = 2 * 128 * Hp * B * S * (S + 1) / 2
    q8, _ = fp8.quantize_rows(q)
    k8, k_scale = fp8.quantize_key_blocks(k, 128)
    out = torch.empty(B, Hp, S, K, dtype=torch.int32, device="cuda")
    r = dict(config=cfg, B=B, S=S, Hp=Hp, Hpk=Hpk, K=K,
             quantize_q_ms=cuda_time_ms(lambda: fp8.quantize_rows(q), **reps),
             quantize_q_direct_store_ms=cuda_time_ms(lambda: direct_store(q), **reps),
             quantize_k_ms=cuda_time_ms(lambda: fp8.quantize_key_blocks(k, 128), **reps),
             quantize_kernels_ms=cuda_time_ms(lambda: select.quantize(q, k, 128, "sm90a"), **reps),
             kernel_fp8_ms=cuda_time_ms(kernel_alone(q8, k8, k_scale, out, K), **reps),
             kernel_fp8_pairs_ms=cuda_time_ms(kernel_alone(q8, k8, k_scale, out, K, "pairs"), **reps),
             select_fp8_ms=cuda_time_ms(lambda: select.select_blocks_cuda(q, k, K, 128, 0.09, "fp8"), **reps),
             select_bf16_ms=cuda_time_ms(lambda: select.select_blocks_cuda(q, k, K, 128, 0.09), **reps))
    r["quantize_floor_ms"] = (3 * q.numel() + 3 * k.numel()) * 2 / (PEAK_TBPS * 1e12) * 1e3
    for name in ("kernel_fp8", "kernel_fp8_pairs", "select_fp8", "select_bf16"):
        r[f"{name}_tflops"] = flops / r[f"{name}_ms"] / 1e9
    # select_fp8 quantises as tuning.fp8_quant says (the fp8_quant kernels on sm90a): its share is that pass's
    r["quantize_share_of_select_fp8"] = r["quantize_kernels_ms"] / r["select_fp8_ms"]
    r["torch_quantize_over_select_fp8"] = (r["quantize_q_ms"] + r["quantize_k_ms"]) / r["select_fp8_ms"]
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long", type=int, default=1 << 20, help="longest B = 1 sequence of (b)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rows = []
    for cfg, (Hp, Hpk) in PROXIES.items():
        for S in (8192, 32768, 131072):
            rows.append(row(cfg, (128 * 1024) // S, S, Hp, Hpk))
            torch.cuda.empty_cache()
    S = 262144
    while S <= args.long:
        rows.append(row("b", 1, S, 8, 1))
        torch.cuda.empty_cache()
        S *= 2
    args.out.write_text(json.dumps({"benchmark": "fp8_select", "commit": commit(), "formula":
                                    "2*Dp*Hp*B*S*(S+1)/2", "device": torch.cuda.get_device_name(), "rows": rows},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
