"""fp8 selection's quantisation pass: the fp8_quant kernels against reference.fp8's torch ops (issue 36's target:
quantisation <= 3% of the fp8 selection time), at (b) Hp = 8, Hpk = 1, Dp = 128: 64K with B = 2, then B = 1 at
128K, 256K and 1M tokens.

Per case: each pass's ms (q_proxy rows + k_proxy key blocks; every call starts with its inputs out of the L2),
its GB/s over the bytes the kernels must move (x read once, e4m3 and the fp32 scales written once), the floor at
4 TB/s, whether the two passes give the same bytes, and fp8 selection's time with each pass and the share the
pass takes of it.
Run: FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_fp8_quant.py --out fp8_quant.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.common import PEAK_TBPS, commit, cuda_time_ms, flushed_event_times
from flash_msa_rt import tuning
from flash_msa_rt.ops import fp8_quant, select
from flash_msa_rt.reference import fp8

CASES = ((2, 65536), (1, 131072), (1, 262144), (1, 1 << 20))  # (B, S) of (b)
HP, HPK, DP, BS, K = 8, 1, 128, 128, 16


def moved_bytes(q: torch.Tensor, k: torch.Tensor) -> int:
    """What one pass must move: inputs read once, e4m3 written once, a row scale per q row, a block scale per k
    block (the kernels write the row scales too: 1% of the bytes at Dp = 128)."""
    B, S = q.shape[:2]
    rows = B * S * q.shape[2]
    blocks = B * -(-S // BS) * k.shape[2]
    return (q.element_size() + 1) * (q.numel() + k.numel()) + 4 * (rows + blocks)


def passes(q, k):
    def torch_pass():
        fp8.quantize_rows(q)
        fp8.quantize_key_blocks(k, BS)

    def kernel_pass():
        fp8_quant.quantize_cuda(q, 1)
        fp8_quant.quantize_cuda(k, BS)

    return {"torch": torch_pass, "kernel": kernel_pass, "kernel_rows": lambda: fp8_quant.quantize_cuda(q, 1),
            "kernel_key_blocks": lambda: fp8_quant.quantize_cuda(k, BS)}


def same_bytes(q, k) -> bool:
    (q8, qs), (k8, ks) = fp8_quant.quantize_cuda(q, 1), fp8_quant.quantize_cuda(k, BS)
    (rq8, rqs), (rk8, rks) = fp8.quantize_rows(q), fp8.quantize_key_blocks(k, BS)
    same8 = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in ((q8, rq8), (k8, rk8)))
    return same8 and torch.equal(qs, rqs) and torch.equal(ks, rks)


def case(B, S, dtype, flush) -> dict:
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(B, S, HP, DP, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, S, HPK, DP, device="cuda", generator=g).to(dtype)
    nbytes = moved_bytes(q, k)
    r = dict(B=B, S=S, Hp=HP, Hpk=HPK, Dp=DP, dtype=str(dtype).replace("torch.", ""), bytes=nbytes,
             floor_ms=nbytes / (PEAK_TBPS * 1e12) * 1e3, byte_equal=same_bytes(q, k))
    for name, fn in passes(q, k).items():
        fn()
        r[f"{name}_ms"] = statistics.median(flushed_event_times(fn, 10, flush))
    r["torch_GBps"] = nbytes / r["torch_ms"] / 1e6
    r["kernel_GBps"] = nbytes / r["kernel_ms"] / 1e6
    r["kernel_x_torch"] = r["torch_ms"] / r["kernel_ms"]
    reps = dict(warmup=1, reps=3) if S >= 262144 else {}  # a 1M selection takes about a second
    for how in ("kernel", "torch"):
        with tuning.override(fp8_quant={"quantize": how}):
            r[f"select_fp8_{how}_ms"] = cuda_time_ms(lambda: select.select_blocks_cuda(q, k, K, BS, 0.09, "fp8"),
                                                     **reps)
        r[f"share_{how}"] = r[f"{how}_ms"] / r[f"select_fp8_{how}_ms"]
    print(" ".join(f"{n}={v:.4g}" if isinstance(v, float) else f"{n}={v}" for n, v in r.items()), flush=True)
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("bf16", "f16"), default="bf16")
    p.add_argument("--max-seqlen", type=int, default=1 << 20, help="skip cases above this S")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MB: 5x the H200's L2
    rows = []
    for B, S in CASES:
        if S <= args.max_seqlen:
            rows.append(case(B, S, dtype, flush))
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"benchmark": "fp8_quant", "commit": commit(), "floor_TBps": PEAK_TBPS,
                                    "device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
