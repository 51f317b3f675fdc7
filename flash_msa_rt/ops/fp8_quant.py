"""fp8 selection's quantisation on the GPU: the fp8_quant kernels (kernels_src/fp8_quant), byte for byte
flash_msa_rt.reference.fp8's quantize_rows (block_size 1) and quantize_key_blocks (block_size Bs) in one pass each:
x read once, e4m3 and the scales written once. No host synchronisation.
"""

from __future__ import annotations

import torch

from flash_msa_rt.loader import get_kernel
from flash_msa_rt.reference.fp8 import E4M3

DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
THREADS = 256  # the one CTA size built (kernels_src/fp8_quant)


def kernel_config(dtype: str, head_dim: int, block_size: int) -> dict:
    """The variant for inputs of dtype and head dim; block_size 1 gives row scales, Bs key-block scales."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "threads": THREADS}


def quantize_cuda(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, scale): x (B, S, H, D) bf16 / f16 on a CUDA device as contiguous e4m3 with one power-of-two scale per
    (b, block of block_size tokens, h) (the last block may be partial); scale float32 (B, ceil(S / block_size), H)
    contiguous. block_size 1 is reference.fp8.quantize_rows, Bs is quantize_key_blocks(x, Bs).

    x: the head dim of unit stride, the other strides 16-byte multiples and the pointer 16-byte aligned (each lane
    loads 16 bytes of a row), which select_blocks_cuda's TMA-ready operands are."""
    B, S, H, D = x.shape
    if x.dtype not in DTYPES:
        raise TypeError(f"quantize_cuda: x has dtype {x.dtype}; supported: {', '.join(map(str, DTYPES))}")
    if x.stride(3) != 1 or any(s * x.element_size() % 16 for s in x.stride()[:3]) or x.data_ptr() % 16:
        raise ValueError(f"quantize_cuda: x with strides {x.stride()} at {x.data_ptr():#x} needs a unit-stride head "
                         f"dim, 16-byte multiple strides and a 16-byte aligned pointer")
    x8 = torch.empty((B, S, H, D), dtype=E4M3, device=x.device)
    scale = torch.empty((B, -(-S // block_size), H), dtype=torch.float32, device=x.device)
    if x.numel():
        get_kernel("fp8_quant", kernel_config(DTYPES[x.dtype], D, block_size), x.device)(x=x, x8=x8, scale=scale)
    return x8, scale
