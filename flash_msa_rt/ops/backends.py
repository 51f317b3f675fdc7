"""The backends an MSA op can run on: what each declares it supports, and the registry dispatch picks from.

The pure-PyTorch reference (flash_msa_rt.reference) is registered here and supports everything: the fallback of
every op. flash_msa_rt.ops.dispatch picks an implementation; flash_msa_rt.ops.kernels is the CUDA kernel backend.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

# msa_kl / warmup_kl: the KL pass alone given the main attention's final lse, (lse_proxy, kl_rows); the forwards
# skip it with kl=False (kl_value "deferred" and "none": the backward runs it, flash_msa_rt.ops.library).
OPS = ("select_blocks", "msa_forward", "msa_backward", "msa_kl", "warmup_forward", "warmup_backward", "warmup_kl",
       "block_sparse_forward", "block_sparse_backward")


@dataclass(frozen=True)
class Problem:
    """What a backend sees when asked whether it can run a call."""

    op: str
    device: torch.device
    dtype: torch.dtype
    config: Mapping[str, Any]


@dataclass(frozen=True)
class Backend:
    """A named set of op implementations for one device type.

    supports(problem) returns None when the backend runs the problem, otherwise the reason it does not (shown to
    the user when the call falls back to the reference). guard(problem), where given, is asked after supports
    accepts a problem, on dispatch's resolution only (not per call): None admits it, a reason declines it like
    supports does, except that the guard has told the user itself (flash_msa_rt.guard: the first-use check of
    cubins never run on this arch's hardware).

    ops maps names of OPS to implementations with flash_msa_rt.ops.library's signatures. msa_forward and
    warmup_forward are also called with kl=False (kl_value "deferred" / "none": lse_proxy and kl_rows returned as
    zeros, the backward then calls msa_kl / warmup_kl, which dispatch resolves like any op); without kl they run
    the KL pass as before.
    """

    name: str
    device_type: str | None  # None: any device
    supports: Callable[[Problem], str | None]
    ops: Mapping[str, Callable] = field(default_factory=dict)
    guard: Callable[[Problem], str | None] | None = None


_backends: list[Backend] = []
_resolved: dict[tuple, Callable] = {}  # dispatch's answers; a change of backends forgets them
_lock = threading.Lock()


def register_backend(backend: Backend) -> None:
    """Add a backend; it is tried before every backend registered earlier (the reference last)."""
    unknown = sorted(set(backend.ops) - set(OPS))
    if unknown:
        raise ValueError(f"register_backend: backend {backend.name!r} implements unknown ops {unknown}; known: "
                         f"{list(OPS)}")
    with _lock:
        _backends.insert(0, backend)
        _resolved.clear()


def unregister_backend(name: str) -> None:
    if name == _REFERENCE.name:
        raise ValueError("unregister_backend: the reference backend is the fallback of every op and stays")
    with _lock:
        _backends[:] = [b for b in _backends if b.name != name]
        _resolved.clear()


def backends() -> list[Backend]:
    return list(_backends)


# --- the reference backend: flash_msa_rt.reference, imported on first use --------------------------------------

def _ref():
    import flash_msa_rt.reference as reference

    return reference


# The varlen references take cu_seqlens at another position than these ops: pass it by keyword. key_offsets:
# cu_seqlens_k / seqused_k (separate key offsets, flash_msa_rt.reference.varlen), passed only where given.

def _select_blocks(q_proxy, k_proxy, top_k_blocks, block_size, scale, cu_seqlens=None, *, precision="bf16",
                   local_blocks=1, **key_offsets):
    if cu_seqlens is None:
        return _ref().select_blocks(q_proxy, k_proxy, top_k_blocks, block_size, scale, precision, local_blocks)
    return _ref().select_blocks_varlen(q_proxy, k_proxy, cu_seqlens=cu_seqlens, top_k_blocks=top_k_blocks,
                                       block_size=block_size, scale=scale, precision=precision,
                                       local_blocks=local_blocks, **key_offsets)


def _without_kl(outputs, kl: bool):
    """The reference computes the KL with the main attention; kl=False returns zeros in its place (out and lse are
    then bitwise those of kl=True, so every kl_value mode's backward sees the same tensors)."""
    out, lse, lse_proxy, kl_rows = outputs
    return outputs if kl else (out, lse, torch.zeros_like(lse_proxy), torch.zeros_like(kl_rows))


# proxy_scale (the proxy scores' scale, given only where it is not the main scale) travels in key_offsets' keywords.

def _msa_forward(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, cu_seqlens=None, *, kl=True,
                 sinks=None, **key_offsets):
    """sinks: out scaled by 1 - p_sink around the sink-free forward, lse sink-free (library's msa_forward)."""
    from flash_msa_rt.ops.sinks import scaled_outputs

    if cu_seqlens is None:
        return scaled_outputs(_without_kl(_ref().msa_forward(q_proxy, k_proxy, q, k, v, block_indices, block_size,
                                                             scale, **key_offsets), kl), sinks)
    return scaled_outputs(_without_kl(_ref().msa_forward_varlen(q_proxy, k_proxy, q, k, v, block_indices,
                                                                cu_seqlens=cu_seqlens, block_size=block_size,
                                                                scale=scale, **key_offsets), kl), sinks)


def _msa_kl(q_proxy, k_proxy, q, k, v, lse, block_indices, block_size, scale, cu_seqlens=None, *, with_kl=True,
            **key_offsets):
    """(lse_proxy, kl_rows): the reference's forward again (it has no KL pass of its own; lse is the same); it
    forms both outputs whatever with_kl."""
    return _msa_forward(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, cu_seqlens, **key_offsets)[2:]


def _msa_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
                  kl_grad, cu_seqlens=None, kl_metric=None, **key_offsets):
    """kl_metric: also the mean KL value into it (the reference's forward again)."""
    if kl_metric is not None:
        kl_rows = _msa_kl(q_proxy, k_proxy, q, k, v, lse, block_indices, block_size, scale, cu_seqlens,
                          **key_offsets)[1]
        kl_metric.copy_(kl_rows.sum() / max(kl_rows.numel(), 1))  # flash_msa_rt.api's kl_loss
    args = (q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale)
    if cu_seqlens is None:
        return _ref().msa_backward(*args, grad_out, kl_grad, **key_offsets)
    return _ref().msa_backward_varlen(*args, grad_out=grad_out, cu_seqlens=cu_seqlens, kl_grad=kl_grad,
                                      **key_offsets)


def _warmup_forward(q_proxy, k_proxy, q, k, v, scale, cu_seqlens=None, *, kl=True, **key_offsets):
    if cu_seqlens is None:
        return _without_kl(_ref().warmup_forward(q_proxy, k_proxy, q, k, v, scale, **key_offsets), kl)
    return _without_kl(_ref().warmup_forward_varlen(q_proxy, k_proxy, q, k, v, cu_seqlens=cu_seqlens, scale=scale,
                                                    **key_offsets), kl)


def _warmup_kl(q_proxy, k_proxy, q, k, v, lse, scale, cu_seqlens=None, *, with_kl=True, **key_offsets):
    """with_kl: the reference forms both outputs either way."""
    return _warmup_forward(q_proxy, k_proxy, q, k, v, scale, cu_seqlens, **key_offsets)[2:]


def _warmup_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, cu_seqlens=None,
                     kl_metric=None, **key_offsets):
    """kl_metric: also the mean KL value into it (the reference's forward again)."""
    if kl_metric is not None:
        kl_rows = _warmup_kl(q_proxy, k_proxy, q, k, v, lse, scale, cu_seqlens, **key_offsets)[1]
        kl_metric.copy_(kl_rows.sum() / max(kl_rows.numel(), 1))  # flash_msa_rt.api's kl_loss
    args = (q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale)
    if cu_seqlens is None:
        return _ref().warmup_backward(*args, grad_out, kl_grad, **key_offsets)
    return _ref().warmup_backward_varlen(*args, grad_out=grad_out, cu_seqlens=cu_seqlens, kl_grad=kl_grad,
                                         **key_offsets)


def _block_sparse_forward(q, k, v, block_indices, block_size, scale, cu_seqlens=None):
    if cu_seqlens is None:
        return _ref().block_sparse_forward(q, k, v, block_indices, block_size, scale)
    return _ref().block_sparse_forward_varlen(q, k, v, block_indices, cu_seqlens=cu_seqlens, block_size=block_size,
                                              scale=scale)


def _block_sparse_backward(q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens=None):
    args = (q, k, v, out, lse, block_indices, block_size, scale)
    if cu_seqlens is None:
        return _ref().block_sparse_backward(*args, grad_out)
    return _ref().block_sparse_backward_varlen(*args, grad_out=grad_out, cu_seqlens=cu_seqlens)


_REFERENCE = Backend(
    name="reference", device_type=None, supports=lambda problem: None,
    ops={"select_blocks": _select_blocks, "msa_forward": _msa_forward, "msa_backward": _msa_backward,
         "msa_kl": _msa_kl, "warmup_forward": _warmup_forward, "warmup_backward": _warmup_backward,
         "warmup_kl": _warmup_kl, "block_sparse_forward": _block_sparse_forward,
         "block_sparse_backward": _block_sparse_backward})
_backends.append(_REFERENCE)


def reference_impl(op: str) -> Callable:
    """The reference implementation of op (for a kernel backend that hands one call over)."""
    return _REFERENCE.ops[op]
