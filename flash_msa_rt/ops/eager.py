"""The eager fast path of the MSA ops: the same bodies as the torch.library custom ops (flash_msa_rt.ops.library),
called from a torch.autograd.Function, for calls that nothing traces.

Why. At small S the op is host-bound ((a) at B = 1, S = 8K: 3.38 ms eager against ~2 ms of device work on the
H200), and the custom ops' machinery (dispatch, autograd wrapper, fake/meta plumbing: three ops forward, two
backward) was most of the API layer's own host time: benchmarks/host_api_cpu.py, op bodies empty, measured 416 us
per forward + backward through the custom ops and 261 us here on the sessions' CPU machine. Here one Function holds
the whole forward (selection, main attention, the KL mean), so a step is one apply and one backward node.
torch.compile, export, make_fx and fake tensors still see the custom ops (usable() leaves them every call they
could observe), and the custom ops remain the public contract (torch.ops.flash_msa.*).

Same semantics as the custom ops: the bodies are theirs, the saved tensors and the backward (library.msa_gradients,
under the forward's tuning overrides) too; gradients that do not arrive stay None. One difference of form: the KL
mean is formed inside the Function, so its gradient reaches the backward as the 0-dim d(loss)/d(kl_rows) (the value
autograd's division and expansion produce, broadcast by every body) instead of an expanded tensor.
"""

from __future__ import annotations

import torch

from flash_msa_rt import tuning
from flash_msa_rt.ops import library

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Dispatch keys in the thread's include set while something traces below autograd: a Python dispatch mode (fake
# tensors, make_fx, FunctionalTensorMode), pre-dispatch tracing (export), C++ functionalization. Read by name: a
# torch without one of them cannot be in that state.
_TRACING_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in ("Python", "PreDispatch", "Functionalize")
                      if hasattr(torch._C.DispatchKey, name))


def usable(*tensors) -> bool:
    """Whether a call on these tensors (None allowed) may take the eager path: not under torch.compile, no dispatch
    mode, pre-dispatch tracing, functionalization, functorch transform, JIT trace or torch-function mode (other than
    a default-device context) active, and plain tensors only (no FakeTensor, FunctionalTensor, DTensor or other
    subclass). Otherwise the custom ops run, which every one of those handles. The state is read through torch's
    private bindings; a torch that lacks one of them takes the custom ops (always correct, only slower)."""
    if torch.compiler.is_compiling():  # first: dynamo folds it and never traces the rest
        return False
    try:
        if torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active() \
                or torch._C._is_tracing():
            return False
        if any(torch._C._dispatch_tls_is_dispatch_key_included(key) for key in _TRACING_KEYS):
            return False
        if torch._C._is_torch_function_mode_enabled() and not _device_modes_only():
            return False
    except (AttributeError, ImportError):
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


def _device_modes_only() -> bool:
    """The torch-function modes on the stack are `with torch.device(...)` contexts only (they change factory
    functions' default device, which the bodies never rely on: every allocation names its device)."""
    from torch.utils._device import DeviceContext

    return all(isinstance(torch._C._get_function_stack_at(i), DeviceContext)
               for i in range(torch._C._len_torch_function_stack()))


_DOUBLE_BACKWARD = (b"flash_msa: the MSA ops' backward has no derivative of its own (a double backward is not "
                    b"supported)")


def _first_order(gradients, *args):
    """gradients(*args), and under create_graph (grad mode on in a backward) made to raise if differentiated, as the
    custom ops' backward does (it has no autograd formula); torch's once_differentiable would instead drop the second
    order silently where the upstream gradient does not require grad."""
    if not torch.is_grad_enabled():
        return gradients(*args)
    with torch.no_grad():
        grads = gradients(*args)
    present = [g.detach().requires_grad_() for g in grads if g is not None]
    if not present:
        return grads
    raised = torch._C._functions.DelayedError(_DOUBLE_BACKWARD, len(present))(*present)
    raised = iter(raised if isinstance(raised, tuple) else (raised,))
    return tuple(None if g is None else next(raised) for g in grads)


def _kl_mean(kl_rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(kl_loss, n): the mean of kl_rows over its n elements, as flash_msa_rt.api forms it on the custom ops."""
    n = max(kl_rows.numel(), 1)
    return kl_rows.sum() / n, n


class _Msa(torch.autograd.Function):
    """flash_msa_func's forward (sparse: selection then msa_forward; else warmup_forward) and its backward:
    (out (B, S, H, D), kl_loss). sinks is an input of its own (its gradient flows); every other option comes in
    opts (flash_msa_rt.ops.options.MsaOptions)."""

    @staticmethod
    def forward(ctx, q_proxy, k_proxy, q, k, v, sinks, opts):
        deferred_metric = None if opts.value_now else opts.kl_metric
        offsets = (opts.cu_seqlens, opts.cu_seqlens_k, opts.seqused_k)
        if opts.sparse:
            block_indices = library.select_blocks_body(q_proxy, k_proxy, opts.K, opts.block_size,
                                                       opts.selection_scale, *offsets, opts.select_precision,
                                                       opts.local_blocks)
            out, lse, lse_proxy, kl_rows = library.msa_forward_body(q_proxy, k_proxy, q, k, v, block_indices,
                                                                    opts.block_size, opts.scale, *offsets, opts.kl,
                                                                    sinks, opts.proxy_scale)
            ctx.save_for_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, *offsets, sinks)
        else:
            out, lse, lse_proxy, kl_rows = library.warmup_forward_body(q_proxy, k_proxy, q, k, v, opts.scale,
                                                                       *offsets, opts.kl, sinks, opts.proxy_scale)
            ctx.save_for_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, *offsets, sinks)
        kl_loss, ctx.kl_count = _kl_mean(kl_rows)
        if not opts.value_now and opts.kl:  # the pass ran for a value that waits for the backward (api._kl_route)
            kl_loss = kl_loss.new_zeros(())
        elif opts.kl_metric is not None and opts.value_now:
            opts.kl_metric.copy_(kl_loss)
        ctx.sparse, ctx.block_size, ctx.scale, ctx.tuning = opts.sparse, opts.block_size, opts.scale, tuning.current()
        ctx.proxy_scale = opts.proxy_scale
        ctx.kl, ctx.kl_metric = opts.kl, deferred_metric  # as library._msa_setup_context
        ctx.kl_rows = kl_rows if opts.kl and deferred_metric is not None else None
        ctx.set_materialize_grads(False)
        return out, kl_loss

    @staticmethod
    def backward(ctx, grad_out, grad_kl_loss):
        grad_kl_rows = None if grad_kl_loss is None else grad_kl_loss / ctx.kl_count
        if ctx.sparse:
            gradients, kl_pass, backward = library.msa_gradients, library.msa_kl_body, library.msa_backward_body
        else:
            gradients, kl_pass, backward = (library.warmup_gradients, library.warmup_kl_body,
                                            library.warmup_backward_body)
        grads = _first_order(library.under_forward_tuning, ctx, gradients, ctx, grad_out, grad_kl_rows, kl_pass,
                             backward)
        return (*grads, None)  # the five inputs' and the sinks' gradients; none for opts


def msa(q_proxy, k_proxy, q, k, v, opts):
    """(out (B, S, H, D), kl_loss) of flash_msa_rt.api's _run on the eager path; opts (MsaOptions) as there: kl and
    value_now say whether the forward runs the KL pass and whether kl_loss holds its value, kl_metric is the
    caller's, written here when value_now, else by the backward."""
    return _Msa.apply(q_proxy, k_proxy, q, k, v, opts.sinks, opts)


class _BlockSparse(torch.autograd.Function):
    """block_sparse_forward and its backward: (out (B, S, H, D), lse (B, H, S), not differentiable)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, block_indices, block_size, scale, cu_seqlens):
        out, lse = library.block_sparse_forward_body(q, k, v, block_indices, block_size, scale, cu_seqlens, sinks)
        ctx.save_for_backward(q, k, v, out, lse, block_indices, cu_seqlens, sinks)
        ctx.block_size, ctx.scale, ctx.tuning = block_size, scale, tuning.current()
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        grads = _first_order(library.under_forward_tuning, ctx, library.block_sparse_gradients, ctx, grad_out,
                             library.block_sparse_backward_body)
        return (*grads,) + (None,) * 4  # (dq, dk, dv, d sinks), then the non-tensor arguments'


def block_sparse(q, k, v, block_indices, block_size, scale, cu_seqlens, sinks=None):
    """(out, lse) of flash_msa_rt.api's block_sparse_attention on the eager path."""
    return _BlockSparse.apply(q, k, v, sinks, block_indices, block_size, scale, cu_seqlens)
