"""Attention sinks on every backend (docs/msa-semantics.md, "Attention sinks"): row-wise steps around the sink-free
attention, whose products never see the sinks (only the sparse forward's merge folds its step in).

Forward: a backend computes out0 and lse0 over the allowed keys; the sink joins the softmax's denominator only,
so lse = logaddexp(lse0, sink) and out = out0 * k, k = exp(lse0 - lse) = 1 - p_sink per row.
Backward: with that out and lse, the usual formulas (delta = <dO, out>, P = exp(s - lse), dS = P (dP - delta)) are
the exact gradients of the sink-adjusted softmax. The KL target tau needs the sink-free P0 = exp(s - lse0), and
P = k P0, so one backward call on lse0 with dO' = k dO serves both: dV = P^T dO = P0^T dO', dP' = dO' V^T = k dP and
delta' = <dO', out> = k delta, so P0 (dP' - delta') = P (dP - delta) = dS, while tau reads P0 as without sinks (the
kernels' fused tau path keeps running). d sink = - sum over (b, i) of exp(sink - lse) * delta.

The sparse forward's kernels scale out in their combine (kernels_src/sparse_combine, scale_rows = 1). The other row
passes run on the bwd_delta kernel where one is built for the tensors (scale_rows = 1: dO read once, dO' and delta
written in the same pass; warmup's, block-sparse attention's and the reference's out0 scaled in place), else in
torch (float32 products, one rounding; delta in query-row chunks, so no full-size float32 temporary exists). The
autograd rules call them through the custom ops flash_msa_rt.ops.library.sink_rows / sink_delta (a kernel launch
is opaque to torch.compile).
"""

from __future__ import annotations

import torch

from flash_msa_rt.loader import built_values, get_kernel
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.ops.grad_cast import aligned_rows
from flash_msa_rt.ops.sparse_bwd import delta_config

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
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


def _row_factor(lse0: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """kept_mass (B, H, S) as a (B, S, H, 1) view, to broadcast over rows of D."""
    return kept_mass(lse0, lse).transpose(1, 2).unsqueeze(-1)


def _rows_kernel(rows: tuple, stats: tuple = (), scale_rows: bool = False) -> dict | None:
    """The bwd_delta variant for (B, S, H, D) tensors `rows` and float32 (B, H, S) `stats`, or None where torch
    runs instead: off CUDA, another dtype, a head dim or arch without a built variant, rows not unit-stride on
    16-byte boundaries (the kernel's vector accesses), statistics not unit-stride along S."""
    x = rows[0]
    dt = _DTYPES.get(x.dtype)
    if dt is None or not x.is_cuda or any(t.dtype != x.dtype or t.shape != x.shape for t in rows):
        return None
    if any(s.dtype != torch.float32 or s.dim() != 3 or s.stride(-1) != 1 for s in stats):
        return None
    if x.shape[3] not in built_values("bwd_delta", "head_dim", arch_of(x.device), dtype=dt,
                                      scale_rows=int(scale_rows)):
        return None
    if not all(aligned_rows(t) for t in rows):
        return None
    return delta_config(dt, x.shape[3], scale_rows)


def _bhs(stat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (B, H, S) statistic as the kernel reads it: float32, unit stride along S."""
    return stat.to(torch.float32).expand(like.shape[0], like.shape[2], like.shape[1]).contiguous()


def scale_out_(out0: torch.Tensor, lse0: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out0 (B, S, H, D), a fresh backend output, times exp(lse0 - lse) per row, in place (float32 products, one
    rounding to out0's dtype). Returns out0."""
    lse0_k, lse_k = _bhs(lse0, out0), _bhs(lse, out0)
    config = _rows_kernel((out0,), (lse0_k, lse_k), scale_rows=True)
    if config is None:
        return torch.mul(out0, _row_factor(lse0, lse), out=out0)
    if out0.numel():  # dout = out = dout_scaled: each lane reads its 16 bytes, then writes them
        scratch = torch.empty(lse0_k.shape, dtype=torch.float32, device=out0.device)
        get_kernel("bwd_delta", config, out0.device)(dout=out0, out=out0, delta=scratch, lse0=lse0_k, lse=lse_k,
                                                     dout_scaled=out0)
    return out0


def scaled_outputs(outputs: tuple, sinks: torch.Tensor | None) -> tuple:
    """A forward's (out, lse0, ...) with out scaled by 1 - p_sink in place (lse stays lse0: the backward and the KL
    need it): the sink step of a forward whose implementation does not take sinks (warmup's cuDNN main attention,
    the reference's msa_forward)."""
    if sinks is None:
        return outputs
    out, lse0, *rest = outputs
    return (scale_out_(out, lse0, lse_with(lse0, sinks)), lse0, *rest)


def scaled_grad_and_delta(grad_out: torch.Tensor, out: torch.Tensor, lse0: torch.Tensor,
                          lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dO', delta): dO' = grad_out (B, S, H, D) times exp(lse0 - lse) per row, a new tensor in grad_out's dtype
    (the upstream gradient a backward on lse0 turns into the sink-adjusted softmax's), and delta = <dO, out>
    float32 (B, H, S) for d sinks; one pass over both on the kernel."""
    lse0_k, lse_k = _bhs(lse0, out), _bhs(lse, out)
    config = _rows_kernel((grad_out, out), (lse0_k, lse_k), scale_rows=True)
    if config is None:
        return torch.mul(grad_out, _row_factor(lse0, lse), out=torch.empty_like(grad_out)), delta(out, grad_out)
    scaled = torch.empty_like(grad_out)
    d = torch.empty(lse0_k.shape, dtype=torch.float32, device=out.device)
    if out.numel():
        get_kernel("bwd_delta", config, out.device)(dout=grad_out, out=out, delta=d, lse0=lse0_k, lse=lse_k,
                                                    dout_scaled=scaled)
    return scaled, d


def delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """<dO, O> per row, float32 (B, H, S), from the output the caller saw (the sink-adjusted one): the bwd_delta
    kernel where one is built for the tensors (each read once), else torch in query-row chunks."""
    B, S, H, D = out.shape
    config = _rows_kernel((out, grad_out))
    if config is not None:
        d = torch.empty((B, H, S), dtype=torch.float32, device=out.device)
        if d.numel():
            get_kernel("bwd_delta", config, out.device)(dout=grad_out, out=out, delta=d)
        return d
    d = torch.empty((B, S, H), dtype=torch.float32, device=out.device)
    for s0, s1 in _row_chunks(out):
        d[:, s0:s1] = (grad_out[:, s0:s1].float() * out[:, s0:s1].float()).sum(dim=-1)
    return d.transpose(1, 2).contiguous()


def sink_gradient(delta_rows: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d sinks (H,) in sinks' dtype: - sum over (b, i) of exp(sink - lse) * delta, from delta (B, H, S) and the
    softmax's lse (sink included). A sink of -inf has probability 0 (no exp(-inf + inf))."""
    sink = sinks.detach().to(lse.dtype).view(1, -1, 1)
    p_sink = torch.where(sink == float("-inf"), torch.zeros((), dtype=lse.dtype, device=lse.device),
                         torch.exp(sink - lse))
    return (-(p_sink * delta_rows.to(lse.dtype)).sum(dim=(0, 2))).to(sinks.dtype)
