"""The selection kernel's launcher: top-K key blocks per (b, p, i) on the GPU (msa-semantics.md, "Selection").

Internal layout (B, S, heads, Dp); the public API (flash_msa_rt.api) validates user input, converts layouts and
routes here through flash_msa_rt.ops.dispatch when a variant is built for the device. Output: int32
(B, Hp, S, K), ascending kept blocks, then the local block, then -1 for empty slots (the reference's order).
"""

from __future__ import annotations

import torch

from flash_msa_rt import loader
from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.tuning import select as tuning_select

DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
MAX_BLOCKS = 1 << 15  # slot block indices are int16 in shared memory


def kernel_config(dtype: str, head_dim: int, block_size: int, max_k: int, mma: str) -> dict:
    """The variant launched for a problem; mma: the tuning policy's (tuning.select)."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "max_k": max_k, "tile_m": 128,
            "threads": 128, "stages": 2, "mma": mma}


def max_k_for(top_k_blocks: int, arch: str) -> int | None:
    """The smallest max_k built for arch that holds top_k_blocks slots per row (variants keep max_k slots in
    registers), or None."""
    return next((m for m in loader.built_values("select", "max_k", arch) if top_k_blocks <= m), None)


def select_blocks_cuda(q_proxy: torch.Tensor, k_proxy: torch.Tensor, top_k_blocks: int, block_size: int,
                       scale: float) -> torch.Tensor:
    """block_indices (B, Hp, S, K) int32 from q_proxy (B, S, Hp, Dp), k_proxy (B, S, Hpk, Dp) on a CUDA device.

    The caller has validated shapes, dtypes and devices; the head dim must have unit stride and the other
    strides be 16-byte multiples (TMA), which slices of a fused projection and transposed (B, H, S, D) views
    satisfy. No host synchronisation.
    """
    B, S, Hp, Dp = q_proxy.shape
    Hpk = k_proxy.shape[2]
    out = torch.empty((B, Hp, S, top_k_blocks), dtype=torch.int32, device=q_proxy.device)
    if out.numel() == 0:
        return out
    arch = arch_of(q_proxy.device)
    config = kernel_config(DTYPES[q_proxy.dtype], Dp, block_size, max_k_for(top_k_blocks, arch),
                           tuning_select.choose(arch).mma)
    kernel = get_kernel("select", config, q_proxy.device)
    kernel(q_proxy=q_proxy, k_proxy=k_proxy, block_indices=out, scale=float(scale), group=Hp // Hpk)
    return out
