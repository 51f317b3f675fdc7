"""proxy_block_scores: stage 1 of MSA selection, the per-key-block max of the causal proxy scores.

scores[b, p, i, j] = max over t in key block j, t <= i, of scale * <q_proxy[b, i, p], k_proxy[b, t, p // (Hp/Hpk)]>
and -inf for blocks after i's own. Not differentiable (selection is a discrete choice).
"""

from __future__ import annotations

import math

import torch

from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.tuning import block_scores as tuning_scores

SUPPORTED_DTYPES = {torch.bfloat16: "bf16"}
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (64, 128)  # 128 ships in the wheel; 64: python -m build_tools build --block-size 64


def kernel_config(dtype: str, head_dim: int, block_size: int, mma: str) -> dict:
    """The variant this op launches for a problem: one tile configuration (128 query rows, 4 warps, 2 K stages),
    on the tuning policy's MMA (tuning.block_scores)."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "tile_m": 128, "threads": 128,
            "stages": 2, "mma": mma}


def _check_inputs(q_proxy, k_proxy, block_size, scale):
    for name, t in (("q_proxy", q_proxy), ("k_proxy", k_proxy)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"proxy_block_scores: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"proxy_block_scores: {name} must be (batch, seqlen, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"proxy_block_scores: {name} has dtype {t.dtype}; supported: "
                            f"{[str(d) for d in SUPPORTED_DTYPES]}")
        if not t.is_cuda:
            raise ValueError(f"proxy_block_scores: {name} must be on a CUDA device, got {t.device}")
    B, S, Hp, Dp = q_proxy.shape
    if k_proxy.shape[0] != B or k_proxy.shape[1] != S or k_proxy.shape[3] != Dp:
        raise ValueError(f"proxy_block_scores: k_proxy shape {tuple(k_proxy.shape)} does not match q_proxy "
                         f"{tuple(q_proxy.shape)} in batch, seqlen or head_dim")
    if k_proxy.dtype != q_proxy.dtype or k_proxy.device != q_proxy.device:
        raise ValueError(f"proxy_block_scores: k_proxy ({k_proxy.dtype}, {k_proxy.device}) must match q_proxy "
                         f"({q_proxy.dtype}, {q_proxy.device})")
    Hpk = k_proxy.shape[2]
    if Hpk < 1 or Hp % Hpk:
        raise ValueError(f"proxy_block_scores: proxy heads {Hp} must be a multiple of proxy key heads {Hpk}")
    if Dp not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"proxy_block_scores: head_dim {Dp} is not supported; supported: "
                                  f"{SUPPORTED_HEAD_DIMS}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise NotImplementedError(f"proxy_block_scores: block_size {block_size} is not supported; supported: "
                                  f"{SUPPORTED_BLOCK_SIZES}")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"proxy_block_scores: scale must be a finite positive number, got {scale!r}")
    return B, S, Hp, Hpk, Dp


def proxy_block_scores(q_proxy: torch.Tensor, k_proxy: torch.Tensor, block_size: int = 128,
                       scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Block scores (B, Hp, S, ceil(S / block_size)) float32 from q_proxy (B, S, Hp, Dp), k_proxy (B, S, Hpk, Dp).

    scale defaults to Dp ** -0.5. The head dim must have unit stride; other strides may be anything 16-byte
    aligned (e.g. slices of a fused projection). out, if given, is a contiguous float32 tensor of the result's
    shape that receives it.
    """
    if scale is None and isinstance(q_proxy, torch.Tensor) and q_proxy.dim() == 4:
        scale = q_proxy.shape[-1] ** -0.5
    B, S, Hp, Hpk, Dp = _check_inputs(q_proxy, k_proxy, block_size, scale)
    nb = -(-S // block_size)
    if out is None:
        scores = torch.empty((B, Hp, S, nb), dtype=torch.float32, device=q_proxy.device)
    else:
        if not isinstance(out, torch.Tensor) or out.shape != (B, Hp, S, nb) or out.dtype != torch.float32 \
                or not out.is_contiguous() or out.device != q_proxy.device:
            raise ValueError(f"proxy_block_scores: out must be a contiguous float32 tensor of shape "
                             f"{(B, Hp, S, nb)} on {q_proxy.device}, got "
                             f"{getattr(out, 'shape', type(out).__name__)}")
        scores = out
    if scores.numel() == 0:  # an empty batch, sequence or head set: nothing to launch
        return scores
    mma = tuning_scores.choose(arch_of(q_proxy.device)).mma
    kernel = get_kernel("block_scores", kernel_config(SUPPORTED_DTYPES[q_proxy.dtype], Dp, block_size, mma),
                        q_proxy.device)
    kernel(q_proxy=q_proxy, k_proxy=k_proxy, scores=scores, scale=float(scale), group=Hp // Hpk)
    return scores
