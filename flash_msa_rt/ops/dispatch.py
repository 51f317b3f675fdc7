"""The one place an MSA op picks its implementation: per (op, device type, dtype, config).

Backends declare what they support (flash_msa_rt.ops.backends); the first registered backend (newest first) that
supports a problem runs it, and the pure-PyTorch reference, supporting everything, is the fallback. The CUDA kernel
backend (flash_msa_rt.ops.kernels) is registered here; when it declines a problem, a CUDA call runs on the
reference and says so once (reset_warnings() re-arms the once-per-process warnings, for tests). A backend may also
carry a guard, asked once a problem is supported: the kernel backend's is flash_msa_rt.guard, the first-use check of
cubins never run on their arch's hardware, which warns itself when it sends a family to the reference.

    register_backend(Backend("kernels-sm90a", "cuda", supports=lambda p: None if ... else "reason", ops={...}))
    impl = implementation("msa_forward", q.device, q.dtype, head_dim=128, block_size=128, varlen=False)

An op implementation takes the arguments of the torch.library op of the same name (flash_msa_rt.ops.library), in
(B, S, heads, D) layout with any strides, and returns fresh tensors.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch

from flash_msa_rt import guard, tuning
from flash_msa_rt.ops import backends as _registry
from flash_msa_rt.ops import kernels
from flash_msa_rt.ops.backends import (OPS, Backend, Problem, backends, reference_impl, register_backend,
                                       unregister_backend)

__all__ = ["OPS", "Backend", "Problem", "backends", "implementation", "reference_impl", "register_backend",
           "reset_warnings", "unregister_backend"]

BUILD_COMMAND = "python -m build_tools build --arch sm90a"
_warned = False
_noted_off_gpu = False


def implementation(op: str, device: torch.device, dtype: torch.dtype, **config: Any) -> Callable:
    """The implementation of `op` for this device, dtype and config (cached: one dict lookup per call)."""
    # The device index belongs to the key (a kernel backend's answer depends on the GPU's arch), and so do the
    # tuning overrides in effect (they choose the variants whose presence decides).
    key = (op, device.type, device.index, dtype, tuple(sorted(config.items())), tuning.current())
    impl = _registry._resolved.get(key)
    if impl is not None:
        return impl
    problem = Problem(op, device, dtype, dict(config))
    declined = []
    guarded = False  # a backend's guard declined: it has warned (or raised) itself
    for backend in _registry._backends:
        if op not in backend.ops or (backend.device_type is not None and backend.device_type != device.type):
            continue
        reason = backend.supports(problem)
        if reason is None and backend.guard is not None:
            # Before the op's work is enqueued; may synchronise once per process and family (flash_msa_rt.guard)
            reason = backend.guard(problem)
            guarded = reason is not None
        if reason is None:
            impl = backend.ops[op]
            break
        declined.append(f"{backend.name}: {reason}")
    assert impl is not None, f"the reference backend implements every op, not {op}"
    if impl is reference_impl(op) and not guarded:
        if device.type == "cuda":
            _warn_reference_on_cuda(problem, declined)
        else:
            _note_reference_off_gpu(problem)
    _registry._resolved[key] = impl
    return impl


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


def _note_reference_off_gpu(problem: Problem) -> None:
    # The README promises this notice: off the GPU the reference is the only implementation, exact but slow.
    global _noted_off_gpu
    if _noted_off_gpu:
        return
    _noted_off_gpu = True
    warnings.warn(
        f"flash_msa: {problem.op} on {problem.device.type} tensors runs on the pure-PyTorch reference "
        f"(flash_msa_rt.reference): exact and slow by design; the kernels run on CUDA tensors of an sm90a or "
        f"sm100a GPU. This notice is shown once.", UserWarning, stacklevel=3)


def reset_warnings() -> None:
    """Re-arm every once-per-process warning of the runtime (the fallback to the reference, deterministic mode's
    fallback, cuDNN's refusal, the first-use guard's verdicts but not its disk cache) and forget the answers that
    decided them, so that the next call decides and warns again: tests call it around each test, so which test sees
    a warning does not depend on their order."""
    global _warned, _noted_off_gpu
    _warned = False
    _noted_off_gpu = False
    kernels.reset_warnings()
    guard.reset()
    _registry._resolved.clear()


if all(b.name != kernels.KERNELS.name for b in _registry._backends):
    # The kernel backend with its first-use guard (flash_msa_rt.guard runs the kernel backend's ops itself, so the
    # two are joined here rather than in kernels.py).
    register_backend(dataclasses.replace(kernels.KERNELS, guard=guard.admit))
