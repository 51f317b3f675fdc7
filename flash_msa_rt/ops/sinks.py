"""Attention sinks on every backend (docs/msa-semantics.md, "Attention sinks"): torch elementwise steps around
the sink-free ops, so no kernel needs to know about them.

Forward: a backend computes out0 and lse0 over the allowed keys; the sink joins the softmax's denominator only,
so lse = logaddexp(lse0, sink) and out = out0 * exp(lse0 - lse) (= out0 * (1 - p_sink)).
Backward: with that out and lse, the usual formulas (delta = <dO, out>, P = exp(s - lse), dS = P (dP - delta)) are
the exact gradients of the sink-adjusted softmax, so the sink-free backward kernels give dq, dk, dv when handed the
sink-including lse. The KL target tau alone needs lse0. d sink = - sum over (b, i) of exp(sink - lse) * delta.
Each step reads and writes (B, S, H, D) in query-row chunks, so no full-size float32 temporary exists.
"""

from __future__ import annotations

import torch

# Elements of a (B, S, H, D) tensor per float32 temporary: 2**26 (256 MiB).
_CHUNK_ELEMS = 1 << 26


def _row_chunks(x: torch.Tensor):
    """[s0, s1) ranges over dim 1 of x (B, S, H, D), each about _CHUNK_ELEMS elements."""
    S = x.shape[1]
    per_row = max(1, x.numel() // max(S, 1))
    rows = max(1, _CHUNK_ELEMS // per_row)
    for s0 in range(0, S, rows):
        yield s0, min(S, s0 + rows)


def lse_with(lse0: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """lse of the softmax with the sink term: logaddexp(lse0 (B, H, S), sinks (H,)); lse0 itself without sinks."""
    if sinks is None:
        return lse0
    return torch.logaddexp(lse0, sinks.detach().to(lse0.dtype).view(1, -1, 1))


def kept_mass(lse0: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """1 - p_sink = exp(lse0 - lse), (B, H, S); 0 where no key is allowed (lse0 = -inf, lse = sink or -inf: a row
    with neither would give exp(NaN)). A NaN in either stays NaN."""
    return torch.where(lse0 == float("-inf"), torch.zeros((), dtype=lse.dtype, device=lse.device),
                       torch.exp(lse0 - lse))


def scale_out_(out0: torch.Tensor, lse0: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out0 (B, S, H, D), a fresh backend output, times exp(lse0 - lse) per row, in place (float32 products, one
    rounding to out0's dtype). Returns out0."""
    factor = kept_mass(lse0, lse).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    for s0, s1 in _row_chunks(out0):
        rows = out0[:, s0:s1]
        rows.copy_(rows.float() * factor[:, s0:s1])
    return out0


def delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """<dO, O> per row, float32 (B, H, S), from the output the caller saw (the sink-adjusted one)."""
    B, S, H, _ = out.shape
    d = torch.empty((B, S, H), dtype=torch.float32, device=out.device)
    for s0, s1 in _row_chunks(out):
        d[:, s0:s1] = (grad_out[:, s0:s1].float() * out[:, s0:s1].float()).sum(dim=-1)
    return d.transpose(1, 2)


def sink_gradient(out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor | None,
                  sinks: torch.Tensor) -> torch.Tensor | None:
    """d sinks (H,) in sinks' dtype: - sum over (b, i) of exp(sink - lse) * delta; None without grad_out (the KL
    does not depend on the sinks). A sink of -inf has probability 0 (no exp(-inf + inf))."""
    if grad_out is None:
        return None
    sink = sinks.detach().to(lse.dtype).view(1, -1, 1)
    p_sink = torch.where(sink == float("-inf"), torch.zeros((), dtype=lse.dtype, device=lse.device),
                         torch.exp(sink - lse))
    return (-(p_sink * delta(out, grad_out)).sum(dim=(0, 2))).to(sinks.dtype)
