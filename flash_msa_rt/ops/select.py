"""The selection kernel's launcher: top-K key blocks per (b, p, i) on the GPU (msa-semantics.md, "Selection").

Internal layout (B, S, heads, Dp); the public API (flash_msa_rt.api) validates user input, converts layouts and
routes here through flash_msa_rt.ops.dispatch when a variant is built for the device. Output: int32
(B, Hp, S, K), ascending kept blocks, then the local_blocks forced blocks ending at the local one (those >= 0),
then -1 for empty slots (the reference's order).
"""

from __future__ import annotations

import torch

from flash_msa_rt import loader
from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops import fp8_quant
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.reference import fp8
from flash_msa_rt.tuning import fp8_quant as tuning_fp8_quant
from flash_msa_rt.tuning import select as tuning_select

DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
MAX_BLOCKS = 1 << 15  # slot block indices are int16 in shared memory


def variant_dtype(input_dtype: str, precision: str) -> str:
    """The variant's operand dtype: the inputs' own, or e4m3 for fp8 selection (of bf16 and f16 inputs alike)."""
    return "e4m3" if precision == "fp8" else input_dtype


PAIRS_STAGES = 4  # kernels_src.select's: the pair in use and the next one in flight
WIDE_BLOCK = 64  # kernels_src.select's "wide" schedule: blocks of 64 scored two per 128-key step (wgmma only)


def kernel_config(dtype: str, head_dim: int, block_size: int, max_k: int, mma: str, schedule: str = "block") -> dict:
    """The variant launched for a problem; mma and schedule: the tuning policy's (tuning.select)."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "max_k": max_k, "tile_m": 128,
            "threads": 128, "stages": PAIRS_STAGES if schedule == "pairs" else 2, "mma": mma, "schedule": schedule}


def schedule_for(arch: str, precision: str, block_size: int = 128) -> str:
    """The tuning policy's loop schedule: at key blocks of 64 on wgmma its block64_schedule ("wide": two blocks per
    step, every dtype), otherwise fp8's schedule ("pairs" is built for e4m3 only) or the one-block loop."""
    t = tuning_select.choose(arch)
    if block_size == WIDE_BLOCK and t.block64_schedule == "wide" and mma_for(arch, precision) == "wgmma":
        return "wide"
    return t.schedule if precision == "fp8" else "block"


def max_k_for(top_k_blocks: int, arch: str) -> int | None:
    """The smallest max_k built for arch that holds top_k_blocks slots per row (variants keep max_k slots in
    registers), or None."""
    return next((m for m in loader.built_values("select", "max_k", arch) if top_k_blocks <= m), None)


def mma_for(arch: str, precision: str) -> str:
    """The tuning policy's MMA; fp8 variants exist on wgmma only (kernels_src/select)."""
    return "wgmma" if precision == "fp8" else tuning_select.choose(arch).mma


def quantize_variants(input_dtype: str, head_dim: int, block_size: int, arch: str, precision: str) -> list:
    """(op, config) of the quantisation kernels fp8 selection launches under the tuning policy (none for bf16
    selection or the torch pass)."""
    if precision != "fp8" or tuning_fp8_quant.choose(arch).quantize != "kernel":
        return []
    return [("fp8_quant", fp8_quant.kernel_config(input_dtype, head_dim, bs)) for bs in (1, block_size)]


def quantize(q_proxy: torch.Tensor, k_proxy: torch.Tensor, block_size: int, arch: str):
    """(q8, k8, k_scale) for fp8 selection: the fp8_quant kernels or reference.fp8's torch ops (tuning.fp8_quant),
    the same bytes. The row scales change no ranking within a row: the select kernel skips them."""
    if tuning_fp8_quant.choose(arch).quantize == "kernel":
        q8, _ = fp8_quant.quantize_cuda(q_proxy, 1)
        k8, k_scale = fp8_quant.quantize_cuda(k_proxy, block_size)
    else:
        q8, _ = fp8.quantize_rows(q_proxy)
        k8, k_scale = fp8.quantize_key_blocks(k_proxy, block_size)
    return q8, k8, k_scale


def select_blocks_cuda(q_proxy: torch.Tensor, k_proxy: torch.Tensor, top_k_blocks: int, block_size: int,
                       scale: float, precision: str = "bf16", local_blocks: int = 1) -> torch.Tensor:
    """block_indices (B, Hp, S, K) int32 from q_proxy (B, S, Hp, Dp), k_proxy (B, S, Hpk, Dp) on a CUDA device.

    The caller has validated shapes, dtypes and devices; the head dim must have unit stride and the other
    strides be 16-byte multiples (TMA), which slices of a fused projection and transposed (B, H, S, D) views
    satisfy. No host synchronisation. precision "fp8": the pair is first quantised to e4m3 (reference.fp8's bytes, by
    the fp8_quant kernels or torch ops: tuning.fp8_quant) and the e4m3 variant scales each key block's scores by its
    k_scale. local_blocks: L, 1 <= L <= top_k_blocks (validated by the caller), the forced recent blocks per row
    (the kernel's runtime scalar: every L runs on the same variant).
    """
    B, S, Hp, Dp = q_proxy.shape
    Hpk = k_proxy.shape[2]
    out = torch.empty((B, Hp, S, top_k_blocks), dtype=torch.int32, device=q_proxy.device)
    if out.numel() == 0:
        return out
    arch = arch_of(q_proxy.device)
    config = kernel_config(variant_dtype(DTYPES[q_proxy.dtype], precision), Dp, block_size,
                           max_k_for(top_k_blocks, arch), mma_for(arch, precision),
                           schedule_for(arch, precision, block_size))
    kernel = get_kernel("select", config, q_proxy.device)
    if precision == "fp8":
        q8, k8, k_scale = quantize(q_proxy, k_proxy, block_size, arch)
        kernel(q_proxy=q8, k_proxy=k8, block_indices=out, k_scale=k_scale, scale=float(scale), group=Hp // Hpk,
               local_blocks=int(local_blocks))
    else:
        kernel(q_proxy=q_proxy, k_proxy=k_proxy, block_indices=out, scale=float(scale), group=Hp // Hpk,
               local_blocks=int(local_blocks))
    return out
