"""Numerics every reference shares: the dtype scores are computed in, and IEEE float32 matmuls."""

from __future__ import annotations

import contextlib

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64 (tests and gradcheck), float32 otherwise (bf16 / fp16 / fp32 inputs)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """lse of a row with no allowed key is -inf; subtracting 0 instead keeps exp(-inf - lse) = 0, not NaN."""
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


@contextlib.contextmanager
def _ieee_fp32_matmul():
    """A float32 reference must not silently run its matmuls in TF32 on the GPU."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        old = m.fp32_precision
        m.fp32_precision = "ieee"
        try:
            yield
        finally:
            m.fp32_precision = old
    else:
        old = m.allow_tf32
        m.allow_tf32 = False
        try:
            yield
        finally:
            m.allow_tf32 = old
