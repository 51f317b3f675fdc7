"""Numerics every reference shares: the dtype scores are computed in, and IEEE float32 matmuls."""

from __future__ import annotations

import contextlib

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any input is float64 (tests and gradcheck), float32 otherwise (bf16 / fp16 / fp32 inputs)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """Non-finite to 0, NaN included: what the kernels' float32 emulation (tests/sparse_emulate.py) does with a
    tile's lse. The references use empty_rows_zero, which keeps NaN."""
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def empty_rows_zero(lse: torch.Tensor) -> torch.Tensor:
    """lse of a row with no allowed key is -inf; subtracting 0 instead keeps exp(-inf - lse) = 0, not NaN. A NaN
    lse stays NaN: a NaN input must reach every output it feeds (msa-semantics.md, "Non-finite inputs")."""
    return torch.where(lse == float("-inf"), torch.zeros((), dtype=lse.dtype, device=lse.device), lse)


def probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse) over the allowed keys (s > -inf) and exactly 0 over the others, also where lse is NaN: a NaN
    row stays NaN on its own keys only, never on keys it cannot see."""
    return torch.where(s == float("-inf"), torch.zeros((), dtype=s.dtype, device=s.device),
                       torch.exp(s - empty_rows_zero(lse).unsqueeze(-1)))


def without_nan(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x with NaN replaced by 0, the NaN mask as x's dtype) or (x, None) when x holds no NaN (one host read).

    A matmul adds 0 * x[t] for every key t a row cannot see, and 0 * NaN is NaN: a NaN key would poison rows that
    never attend to it. The masked products therefore run on the cleaned tensor, and the NaN is put back exactly
    where an allowed key carries it (nan_where)."""
    nan = torch.isnan(x)
    if not bool(nan.any()):
        return x, None
    return torch.where(nan, torch.zeros((), dtype=x.dtype, device=x.device), x), nan.to(x.dtype)


def nan_where(result: torch.Tensor, hits: torch.Tensor | None) -> torch.Tensor:
    """result with NaN where hits > 0 (hits: how many NaN operands an element's sum had, from a matmul of the
    allowed-key mask with without_nan's mask)."""
    if hits is None:
        return result
    return torch.where(hits > 0, torch.full((), float("nan"), dtype=result.dtype, device=result.device), result)


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
