"""The backward's fp32 accumulators cast into their gradients (kernels_src/grad_cast).

Every gradient of the sparse and warmup backward is summed in fp32 and cast once into the input's dtype, in the
input's layout. Where the gradient's rows are strided (a head slice of a run of head chunks, or the (B, H, S, D)
layout's transposed view) the grad_cast kernel writes them in 16-byte vectors; torch's copy_ of such views moves
one element per lane. Contiguous casts stay torch's (vectorised already, and one op of host time).
"""

from __future__ import annotations

import torch

from flash_msa_rt.loader import built_values, get_kernel
from flash_msa_rt.ops.device import arch_of

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_VECTOR_BYTES = 16


def aligned_rows(t: torch.Tensor) -> bool:
    """Unit-stride rows on 16-byte boundaries (the row kernels' vector accesses: grad_cast, bwd_delta)."""
    per_vector = _VECTOR_BYTES // t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % _VECTOR_BYTES == 0 and all(s % per_vector == 0 for s in t.stride()[:-1])


def _kernel_config(acc: torch.Tensor, grad: torch.Tensor) -> dict | None:
    """The grad_cast variant for this pair, or None where torch's copy_ runs instead: off CUDA, another dtype or
    rank, a head dim or arch without a built variant, unaligned rows."""
    dt = _DTYPES.get(grad.dtype)
    if dt is None or not grad.is_cuda or acc.dtype != torch.float32 or grad.dim() != 4 or acc.shape != grad.shape:
        return None
    D = grad.shape[3]
    if D not in built_values("grad_cast", "head_dim", arch_of(grad.device), dtype=dt):
        return None
    if not (aligned_rows(acc) and aligned_rows(grad)):
        return None
    return {"dtype": dt, "head_dim": D, "threads": 256}


def cast_into(acc: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """grad (B, S, heads, D), any strides, = acc (fp32, the same shape) rounded to grad's dtype; returns grad."""
    config = _kernel_config(acc, grad)
    if config is None:
        return grad.copy_(acc)
    if grad.numel():
        get_kernel("grad_cast", config, grad.device)(acc=acc, grad=grad)
    return grad


def cast_like(acc: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The fp32 accumulator of t's gradient cast to t's dtype, in t's layout (torch.empty_like): for a (B, S, heads,
    D) view of a (B, heads, S, D) leaf, a contiguous gradient would make autograd copy it into the leaf's layout
    (+8 GiB for q at (b) 1M); the cast writes that layout at no extra cost (rows of D stay contiguous)."""
    if acc.stride() == t.stride():  # one op where the layouts agree (host time of small problems)
        return acc.to(t.dtype)
    return cast_into(acc, torch.empty_like(t))
