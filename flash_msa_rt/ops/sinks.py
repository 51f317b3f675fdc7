"""Attention sinks on every backend (docs/msa-semantics.md, "Attention sinks"): torch elementwise steps around
the sink-free ops, so no kernel needs to know about them.

Forward: a backend computes out0 and lse0 over the allowed keys; the sink joins the softmax's denominator only,
so lse = logaddexp(lse0, sink) and out = out0 * exp(lse0 - lse) (= out0 * (1 - p_sink)).
Backward: with that out and lse, the usual formulas (delta = <dO, out>, P = exp(s - lse), dS = P (dP - delta)) are
the exact gradients of the sink-adjusted softmax. The KL target tau needs the sink-free P0 = exp(s - lse0), and
P = k P0 with k = exp(lse0 - lse) per row, so one backward call on lse0 with dO' = k dO serves both: dV = P^T dO =
P0^T dO', dP' = dO' V^T = k dP and delta' = <dO', out> = k delta, so P0 (dP' - delta') = P (dP - delta) = dS, while
tau reads P0 as without sinks (the kernels' fused tau path keeps running). d sink = - sum over (b, i) of
exp(sink - lse) * delta. The scalings are one elementwise pass each (float32 products, one rounding); delta reads
(B, S, H, D) in query-row chunks, so no full-size float32 temporary exists.
"""

from __future__ import annotations

import torch

from flash_msa_rt.loader import built_values, get_kernel
from flash_msa_rt.ops.device import arch_of
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


def scale_out_(out0: torch.Tensor, lse0: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out0 (B, S, H, D), a fresh backend output, times exp(lse0 - lse) per row, in place (float32 products, one
    rounding to out0's dtype). Returns out0."""
    return torch.mul(out0, _row_factor(lse0, lse), out=out0)


def scaled_grad(grad_out: torch.Tensor, lse0: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """dO' = grad_out (B, S, H, D) times exp(lse0 - lse) per row, a new tensor in grad_out's dtype (float32
    products, one rounding): the upstream gradient a backward on lse0 turns into the sink-adjusted softmax's."""
    return torch.mul(grad_out, _row_factor(lse0, lse), out=torch.empty_like(grad_out))


def _row_factor(lse0: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """kept_mass (B, H, S) as a (B, S, H, 1) view, to broadcast over rows of D."""
    return kept_mass(lse0, lse).transpose(1, 2).unsqueeze(-1)


def delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """<dO, O> per row, float32 (B, H, S), from the output the caller saw (the sink-adjusted one): the backward's
    bwd_delta kernel where one is built for the tensors (each read once), else torch in query-row chunks."""
    B, S, H, D = out.shape
    config = _delta_kernel_config(out, grad_out)
    if config is not None:
        d = torch.empty((B, H, S), dtype=torch.float32, device=out.device)
        if d.numel():
            get_kernel("bwd_delta", config, out.device)(dout=grad_out, out=out, delta=d)
        return d
    d = torch.empty((B, S, H), dtype=torch.float32, device=out.device)
    for s0, s1 in _row_chunks(out):
        d[:, s0:s1] = (grad_out[:, s0:s1].float() * out[:, s0:s1].float()).sum(dim=-1)
    return d.transpose(1, 2)


def _delta_kernel_config(out: torch.Tensor, grad_out: torch.Tensor) -> dict | None:
    """The bwd_delta variant for (out, grad_out), or None: off CUDA, another dtype, a head dim or arch without a
    built variant, rows not unit-stride on 16-byte boundaries (the kernel's vector loads)."""
    dt = _DTYPES.get(out.dtype)
    if dt is None or not out.is_cuda or grad_out.dtype != out.dtype or grad_out.shape != out.shape:
        return None
    if out.shape[3] not in built_values("bwd_delta", "head_dim", arch_of(out.device), dtype=dt):
        return None
    if not all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:-1])
               for t in (out, grad_out)):
        return None
    return delta_config(dt, out.shape[3])


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
