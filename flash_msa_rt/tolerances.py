"""How far a kernel's result may sit from the float64 reference: dtype-relative tolerances (FlashAttention's rule).

A kernel computing in a 16-bit dtype cannot beat what that dtype costs, so its bound is a small multiple of the
error of the same computation at lower precision, never a fixed number:

    bound = factor * dtype_error + atol_rel * max(1, max |exact|)
    dtype_error = max |baseline - exact| over the positions where both are finite, the baselines being
                  the float32 reference (what float32 accumulation costs) and, for results returned in a 16-bit
                  dtype, the exact result rounded to that dtype (what storing it costs).

Before any number is compared, NaN positions, inf positions and the signs of the infinities must match (FlashMLA's
rule): a kernel that hides a NaN or makes one up fails whatever its error elsewhere.

Used by `python -m flash_msa_rt selftest` and by the GPU tests; torch only, no device needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The multiple of the dtype's own error a kernel may cost. 4 is what the GPU suite's sparse forward, backward,
# warmup and block-sparse checks hold on the H200 (tests/test_*_gpu.py: factor=4.0 against this same baseline).
FACTOR = 4.0
# The floor, relative to the result's magnitude: float32 statistics (lse, KL rows) whose float32 reference is exact
# to the last bits would otherwise get a bound of a few ulps of float32. 1e-5 is the backward tests' floor.
ATOL_REL = 1e-5

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Comparison:
    """One quantity against its exact value. problem is None when it passes, else why it does not."""

    name: str
    max_error: float
    bound: float
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def ratio(self) -> float:
        """max_error / bound (inf for a failed position check): the table's "error / tolerance" column."""
        if self.problem is not None and self.max_error <= self.bound:
            return float("inf")
        return self.max_error / self.bound if self.bound > 0 else (0.0 if self.max_error == 0 else float("inf"))

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAIL: {self.problem}"
        return f"{self.name}: max error {self.max_error:.3e} / bound {self.bound:.3e} ({verdict})"


def magnitude(exact: torch.Tensor) -> float:
    """max |exact| over finite positions (0 for none)."""
    fin = torch.isfinite(exact)
    return exact.double()[fin].abs().max().item() if fin.any() else 0.0


def dtype_error(exact: torch.Tensor, *baselines: torch.Tensor) -> float:
    """max |baseline - exact| over positions where both are finite: what computing at lower precision costs."""
    worst = 0.0
    w = exact.double()
    for b in baselines:
        b = b.double()
        fin = torch.isfinite(b) & torch.isfinite(w)
        if fin.any():
            worst = max(worst, (b[fin] - w[fin]).abs().max().item())
    return worst


def bound(exact: torch.Tensor, result_dtype: torch.dtype, baseline32: torch.Tensor | None = None, *,
          factor: float = FACTOR, atol_rel: float = ATOL_REL) -> float:
    """The bound for a result of result_dtype against exact (float64), per the rule in the module docstring.

    float64 results (a float64 run of a reference) get float64's rounding only: 1e-10 of the magnitude.
    """
    mag = max(1.0, magnitude(exact))
    if result_dtype == torch.float64:
        return 1e-10 * mag
    baselines = [baseline32] if baseline32 is not None else []
    if result_dtype in _SIXTEEN_BIT:
        baselines.append(exact.to(result_dtype))
    return factor * dtype_error(exact, *baselines) + atol_rel * mag


def compare(name: str, got: torch.Tensor, exact: torch.Tensor, limit: float) -> Comparison:
    """got against exact: same shape, same NaN / inf positions and signs, then max |got - exact| <= limit."""
    if tuple(got.shape) != tuple(exact.shape):
        return Comparison(name, float("inf"), limit, f"shape {tuple(got.shape)} != {tuple(exact.shape)}")
    g, w = got.detach().double(), exact.detach().double()
    for what, test in (("NaN", torch.isnan), ("inf", torch.isinf)):
        a, b = test(g), test(w)
        if not torch.equal(a, b):
            extra, missing = int((a & ~b).sum()), int((b & ~a).sum())
            return Comparison(name, float("inf"), limit,
                              f"{what} positions differ ({extra} unexpected, {missing} missing)")
    inf = torch.isinf(w)
    if not torch.equal(g[inf], w[inf]):
        return Comparison(name, float("inf"), limit, "infinities of different sign")
    fin = torch.isfinite(w)
    err = (g[fin] - w[fin]).abs().max().item() if fin.any() else 0.0
    problem = None if err <= limit else f"max error {err:.3e} > bound {limit:.3e}"
    return Comparison(name, err, limit, problem)


def check(name: str, got: torch.Tensor, exact: torch.Tensor, baseline32: torch.Tensor | None = None, *,
          result_dtype: torch.dtype | None = None, factor: float = FACTOR, atol_rel: float = ATOL_REL) -> Comparison:
    """compare() under bound(): result_dtype defaults to got's dtype (pass float32 for float32 statistics)."""
    dtype = result_dtype if result_dtype is not None else got.dtype
    return compare(name, got, exact, bound(exact, dtype, baseline32, factor=factor, atol_rel=atol_rel))


def assert_ok(comparison: Comparison) -> Comparison:
    """For tests: raise AssertionError with the comparison's verdict unless it passes."""
    assert comparison.ok, str(comparison)
    return comparison


def selection_epsilon(q_proxy: torch.Tensor, k_proxy: torch.Tensor, scale: float) -> float:
    """Near-tie epsilon of the selection (msa-semantics.md, "Near ties"): a bound on the fp32 accumulation error
    of one proxy score, Dp products of 16-bit values (4 Dp ulps of float32 at the largest possible score), the
    rule tests/test_select_gpu.py holds."""
    Dp = q_proxy.shape[-1]
    mag = (q_proxy.double().abs().amax() * k_proxy.double().abs().amax() * Dp * scale).item()
    return 4 * Dp * 2.0 ** -24 * mag
