"""Pure-PyTorch references of every MSA op (docs/msa-semantics.md). Torch only, no cutlass.

Slow on purpose and meant for tests: inputs are upcast to float32 (float64 stays float64), TF32 is off, query rows
are processed in chunks that each score only the causal prefix they can see (never an S x S tensor), and the
backward passes are written from the explicit formulas rather than autograd through a dense mask.
Layout everywhere: (B, S, heads, D). lse, lse_proxy and kl_rows come back in the compute dtype (float32, or
float64 for float64 inputs); outputs and gradients in their input's dtype.
"""

from flash_msa_rt.reference.block_scores import proxy_block_scores
from flash_msa_rt.reference.block_sparse import block_sparse_backward, block_sparse_forward
from flash_msa_rt.reference.msa import msa_backward, msa_forward
from flash_msa_rt.reference.numerics import _ieee_fp32_matmul
from flash_msa_rt.reference.selection import select_blocks
from flash_msa_rt.reference.varlen import (block_sparse_backward_varlen, block_sparse_forward_varlen,
                                           msa_backward_varlen, msa_forward_varlen, select_blocks_varlen,
                                           warmup_backward_varlen, warmup_forward_varlen)
from flash_msa_rt.reference.warmup import warmup_backward, warmup_forward

__all__ = [
    "proxy_block_scores",
    "select_blocks",
    "msa_forward",
    "msa_backward",
    "warmup_forward",
    "warmup_backward",
    "block_sparse_forward",
    "block_sparse_backward",
    "select_blocks_varlen",
    "msa_forward_varlen",
    "msa_backward_varlen",
    "warmup_forward_varlen",
    "warmup_backward_varlen",
    "block_sparse_forward_varlen",
    "block_sparse_backward_varlen",
]
