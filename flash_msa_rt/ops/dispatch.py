"""The one place an MSA op picks its implementation: per (op, device type, dtype, config).

Backends declare what they support; the first registered backend (newest first) that supports a problem runs it,
and the pure-PyTorch reference, registered here and supporting everything, is the fallback. The kernel backend
registers itself for CUDA devices through register_backend(); until it does, or when it declines a problem, a
CUDA call runs on the reference and says so once.

    register_backend(Backend("kernels-sm90a", "cuda", supports=lambda p: None if ... else "reason", ops={...}))
    impl = implementation("msa_forward", q.device, q.dtype, head_dim=128, block_size=128, varlen=False)

An op implementation takes the arguments of the torch.library op of the same name (flash_msa_rt.ops.library), in
(B, S, heads, D) layout with any strides, and returns fresh tensors.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

BUILD_COMMAND = "python -m build_tools build --arch sm90a"

OPS = ("select_blocks", "msa_forward", "msa_backward", "warmup_forward", "warmup_backward", "block_sparse_forward",
       "block_sparse_backward")


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
    the user when the call falls back to the reference).
    """

    name: str
    device_type: str | None  # None: any device
    supports: Callable[[Problem], str | None]
    ops: Mapping[str, Callable] = field(default_factory=dict)


_backends: list[Backend] = []
_resolved: dict[tuple, Callable] = {}
_warned = False
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


def implementation(op: str, device: torch.device, dtype: torch.dtype, **config: Any) -> Callable:
    """The implementation of `op` for this device, dtype and config (cached: one dict lookup per call)."""
    # The device index belongs to the key: a kernel backend's answer depends on the GPU's arch.
    key = (op, device.type, device.index, dtype, tuple(sorted(config.items())))
    impl = _resolved.get(key)
    if impl is not None:
        return impl
    problem = Problem(op, device, dtype, dict(config))
    declined = []
    for backend in _backends:
        if op not in backend.ops or (backend.device_type is not None and backend.device_type != device.type):
            continue
        reason = backend.supports(problem)
        if reason is None:
            impl = backend.ops[op]
            break
        declined.append(f"{backend.name}: {reason}")
    assert impl is not None, f"the reference backend implements every op, not {op}"
    if device.type == "cuda" and impl is _reference_impl(op):
        _warn_reference_on_cuda(problem, declined)
    _resolved[key] = impl
    return impl


def _reference_impl(op: str) -> Callable:
    return _REFERENCE.ops[op]


def _warn_reference_on_cuda(problem: Problem, declined: list[str]) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    why = "; ".join(declined) if declined else "no flash-msa kernels are loaded for CUDA devices"
    warnings.warn(
        f"flash_msa: {problem.op} on {problem.device} ({problem.dtype}, {dict(problem.config)}) runs on the slow "
        f"pure-PyTorch reference ({why}). Build the kernels with `{BUILD_COMMAND}` (or --arch sm100a). "
        f"This warning is shown once.", RuntimeWarning, stacklevel=3)


# --- the reference backend: flash_msa_rt.reference, imported on first use --------------------------------------

def _ref():
    import flash_msa_rt.reference as reference

    return reference


# The varlen references take cu_seqlens at another position than these ops: pass it by keyword.

def _select_blocks(q_proxy, k_proxy, top_k_blocks, block_size, scale, cu_seqlens=None):
    if cu_seqlens is None:
        return _ref().select_blocks(q_proxy, k_proxy, top_k_blocks, block_size, scale)
    return _ref().select_blocks_varlen(q_proxy, k_proxy, cu_seqlens=cu_seqlens, top_k_blocks=top_k_blocks,
                                       block_size=block_size, scale=scale)


def _msa_forward(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, cu_seqlens=None):
    if cu_seqlens is None:
        return _ref().msa_forward(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale)
    return _ref().msa_forward_varlen(q_proxy, k_proxy, q, k, v, block_indices, cu_seqlens=cu_seqlens,
                                     block_size=block_size, scale=scale)


def _msa_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
                  kl_grad, cu_seqlens=None):
    args = (q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale)
    if cu_seqlens is None:
        return _ref().msa_backward(*args, grad_out, kl_grad)
    return _ref().msa_backward_varlen(*args, grad_out=grad_out, cu_seqlens=cu_seqlens, kl_grad=kl_grad)


def _warmup_forward(q_proxy, k_proxy, q, k, v, scale, cu_seqlens=None):
    if cu_seqlens is None:
        return _ref().warmup_forward(q_proxy, k_proxy, q, k, v, scale)
    return _ref().warmup_forward_varlen(q_proxy, k_proxy, q, k, v, cu_seqlens=cu_seqlens, scale=scale)


def _warmup_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, cu_seqlens=None):
    args = (q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale)
    if cu_seqlens is None:
        return _ref().warmup_backward(*args, grad_out, kl_grad)
    return _ref().warmup_backward_varlen(*args, grad_out=grad_out, cu_seqlens=cu_seqlens, kl_grad=kl_grad)


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
         "warmup_forward": _warmup_forward, "warmup_backward": _warmup_backward,
         "block_sparse_forward": _block_sparse_forward, "block_sparse_backward": _block_sparse_backward})
_backends.append(_REFERENCE)


def reference_impl(op: str) -> Callable:
    """The reference implementation of op (for a kernel backend that hands one call over)."""
    return _reference_impl(op)


def register_kernels() -> None:
    """Register the CUDA kernel backend once, whichever of this module and flash_msa_rt.ops.kernels is imported
    first (each imports the other: when kernels is the one still importing, it calls this at its end)."""
    import sys

    pending = sys.modules.get("flash_msa_rt.ops.kernels")
    if pending is not None and not hasattr(pending, "KERNELS"):
        return
    from flash_msa_rt.ops import kernels

    if all(b.name != kernels.KERNELS.name for b in _backends):
        register_backend(kernels.KERNELS)


register_kernels()
