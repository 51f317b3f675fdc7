"""Pure-PyTorch references of every MSA op (shared/design/msa-semantics.md). Torch only, no cutlass.

Slow on purpose and meant for tests: inputs are upcast to float32 (float64 stays float64), TF32 is off, query rows
are processed in chunks that each score only the causal prefix they can see (never an S x S tensor), and the
backward passes are written from the explicit formulas rather than autograd through a dense mask.
Layout everywhere: (B, S, heads, D).
"""

from flash_msa_rt.reference.block_scores import proxy_block_scores
from flash_msa_rt.reference.numerics import _ieee_fp32_matmul

__all__ = ["proxy_block_scores"]
