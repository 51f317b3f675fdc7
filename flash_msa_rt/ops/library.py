"""The MSA ops as torch.library custom ops (namespace flash_msa): fake impls for tracing, autograd formulas.

Every op takes (B, S, heads, D) tensors of any strides with a unit-stride head dim and returns fresh contiguous
tensors; with cu_seqlens (int32 (num_seqs + 1,)) B must be 1 and dim 1 holds the packed sequences. Selection, MSA
and warmup also take cu_seqlens_k and seqused_k (separate key offsets: then cu_seqlens splits the queries, q_proxy
and q, and cu_seqlens_k the keys, k_proxy, k and v; semantics in flash_msa_rt.reference.varlen). The real
implementations come from flash_msa_rt.ops.dispatch (a kernel backend where one is registered, else the
reference). Custom ops make the calls opaque to torch.compile (fullgraph works) and give one registration for
autograd, fake tensors and export. Each op's body is a plain function (select_blocks_body, msa_forward_body, ...)
that the eager fast path (flash_msa_rt.ops.eager) calls without the custom-op machinery, and the gradients of the
forwards (msa_gradients, warmup_gradients) are one function for both paths.

Autograd: the differentiable outputs are `out` (to q, k, v) and `kl_rows` (to q_proxy, k_proxy only: tau is
detached); lse and lse_proxy are saved for the backward and marked non-differentiable. Gradients that do not arrive
are passed to the backward op as None instead of materialised zeros. A backward runs under the tuning overrides
its forward ran under (flash_msa_rt.tuning.override): autograd runs it on its own threads.

Options of issue 58 (docs/msa-semantics.md): local_blocks reaches the selection; proxy_scale (None: the main
scale) the KL pass and the proxy backward; sinks (float32 (H,) or None): msa_forward's implementation takes them and
returns out scaled by 1 - p_sink with the sink-free lse0 as `lse` (the KL target's; the softmax's lse is
logaddexp(lse, sinks)); the warmup forward scales its backend's out itself (flash_msa_rt.ops.sinks), and
block_sparse_forward returns the sink-including lse (it has no KL). The autograd rules fold the sinks into the
upstream gradient (exact for the sink-adjusted softmax, tau stays sink-free: _fold_sinks) and run the backward as
without them, and add d sinks. A backend sees proxy_scale (and select local_blocks, msa_forward sinks) only where
given, and its config says so, so a kernel backend that lacks one declines exactly those calls.

KL value modes (kl_value of the public API): with kl=False the forwards skip the KL pass and return zeros for
lse_proxy and kl_rows; their backward runs the KL pass (msa_kl, warmup_kl: the same kernels on the same lse, so the
same lse_proxy and gradients) where the proxy's gradient or the caller's kl_metric needs it, and writes the KL value
(mean of kl_rows, as flash_msa_rt.api forms kl_loss) into kl_metric on the device.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from flash_msa_rt import tuning
from flash_msa_rt.ops import dispatch, offsets, sparse_plan, validation
from flash_msa_rt.ops import sinks as _sinks

NAMESPACE = "flash_msa"


def _fresh(*tensors: Tensor):
    """Contiguous outputs, as the fake impls promise (a backend may hand back views of its own buffers)."""
    out = tuple(t.contiguous() for t in tensors)
    return out if len(out) > 1 else out[0]


def _like(*tensors: Tensor):
    """Fake outputs shaped, typed and placed like the inputs, contiguous."""
    return tuple(t.new_empty(t.shape) for t in tensors)


def _layout_of(t: Tensor) -> tuple:
    """The strides torch.empty_like(t) gives, on the dims longer than 1 (a size-1 dim's stride is arbitrary): t's
    own where t is dense and non-overlapping (the (B, S, heads, D) view of a (B, heads, S, D) input), else
    contiguous ones."""
    long = [(st, n) for st, n in zip(t.stride(), t.shape) if n != 1]
    expected = 1
    for st, n in sorted(long):
        if st != expected:
            return _contiguous_strides(t.shape)
        expected *= n
    return tuple(st for st, _ in long)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        if n != 1:
            strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _grads_like(inputs: tuple, grads) -> tuple:
    """Each gradient laid out as torch.empty_like(its input) would be. Autograd copies a leaf's gradient into the
    leaf's layout when the two differ (+8 GiB for q at (b) 1M with (B, H, S, D) leaves, docs/memory.md); the kernels
    write theirs in that layout already, so this copies only what another backend returned otherwise."""
    out = []
    for x, g in zip(inputs, grads):
        if g.shape != x.shape or tuple(st for st, n in zip(g.stride(), g.shape) if n != 1) != _layout_of(x):
            g = torch.empty_like(x, dtype=g.dtype).copy_(g)
        out.append(g)
    return tuple(out)


def _fake_grads(*tensors: Tensor):
    """Fake gradients: torch.empty_like of each input (the real ones' layout: _grads_like)."""
    return tuple(torch.empty_like(t) for t in tensors)


def _msa_config(q_proxy: Tensor, q: Tensor, k: Tensor, block_size: int | None, cu_seqlens, cu_seqlens_k,
                proxy_scale=None) -> dict:
    # Separate key offsets are a varlen call: a backend that declines varlen declines them too.
    config = {"head_dim": q.shape[-1], "proxy_head_dim": q_proxy.shape[-1], "block_size": block_size,
              "group": q.shape[2] // q_proxy.shape[2], "kv_group": q.shape[2] // k.shape[2],
              "varlen": cu_seqlens is not None or cu_seqlens_k is not None, "separate_keys": cu_seqlens_k is not None}
    if proxy_scale is not None:  # only where given: the default's dispatch key (and answer) stays today's
        config["proxy_scale"] = True
    return config


def _proxy_scale(proxy_scale) -> dict:
    """proxy_scale for an implementation, only where given (None: the main scale, which every backend takes)."""
    return {} if proxy_scale is None else {"proxy_scale": float(proxy_scale)}


def _key_offsets(op: str, cu_seqlens, cu_seqlens_k, seqused_k) -> dict:
    """The key-offset keywords for an implementation, only where given: the kernel backend's implementations
    (which decline every varlen call) never see them."""
    if cu_seqlens is None and (cu_seqlens_k is not None or seqused_k is not None):
        raise ValueError(f"flash_msa::{op}: cu_seqlens_k and seqused_k need cu_seqlens (the query offsets)")
    if cu_seqlens_k is None and seqused_k is not None:
        raise ValueError(f"flash_msa::{op}: seqused_k needs cu_seqlens_k (the key start of each sequence)")
    given = {"cu_seqlens_k": cu_seqlens_k, "seqused_k": seqused_k}
    return {name: t for name, t in given.items() if t is not None}


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of lse, lse_proxy and kl_rows: float32, float64 for float64 inputs (tests, gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in dtype; t itself when it has it (Tensor.to would still dispatch a torch op: host time per call)."""
    return t if t.dtype == dtype else t.to(dtype)


def _stats(q: Tensor, out: Tensor, *stats: Tensor):
    """out and the statistics as fresh contiguous tensors, statistics in stat_dtype (the fake impls' promise)."""
    dt = stat_dtype(q.dtype)
    return (out.contiguous(), *(_as(s, dt).contiguous() for s in stats))


def _kl_flag(kl: bool) -> dict:
    """kl=False for a forward without the KL pass; nothing otherwise (a backend's forward takes kl only where a
    kl_value mode other than "exact" asks for it)."""
    return {} if kl else {"kl": False}


def _stats_only(q: Tensor, *stats: Tensor):
    """_stats without an out."""
    dt = stat_dtype(q.dtype)
    return tuple(_as(s, dt).contiguous() for s in stats)


def _impl(op: str, like: Tensor, config: dict):
    return dispatch.implementation(op, like.device, like.dtype, **config)


def _planned(max_seqlen: int | None, impl, *args, **kwargs):
    """impl(*args, **kwargs), with a max_seqlen (the ops' packed-offsets bound, given under torch.compile: api) the
    packs planned on the device from it, as under CUDA graph capture (flash_msa_rt.ops.packed), no host read."""
    if max_seqlen is None:
        return impl(*args, **kwargs)
    with offsets.planned_with(max_seqlen):
        return impl(*args, **kwargs)


def _bound(max_seqlen: int | None) -> dict:
    """The max_seqlen keyword for an op (or a body) where there is one: the eager path's bodies never get it."""
    return {} if max_seqlen is None else {"max_seqlen": max_seqlen}


# --- selection ---------------------------------------------------------------------------------------------------

def select_blocks_body(q_proxy, k_proxy, top_k_blocks, block_size, scale, cu_seqlens=None, cu_seqlens_k=None,
                       seqused_k=None, precision="bf16", local_blocks=1, max_seqlen=None):
    """select_blocks' body (the custom op's and the eager path's)."""
    config = {"proxy_head_dim": q_proxy.shape[-1], "block_size": block_size, "top_k_blocks": top_k_blocks,
              "varlen": cu_seqlens is not None or cu_seqlens_k is not None, "separate_keys": cu_seqlens_k is not None,
              "select_precision": precision}
    # An implementation takes precision only where it is fp8 (as forwards take kl only where it is off), and
    # local_blocks only where it is not 1.
    extra = {"precision": precision} if precision != "bf16" else {}
    if local_blocks != 1:
        config["local_blocks"] = extra["local_blocks"] = local_blocks
    impl = _impl("select_blocks", q_proxy, config)
    return _fresh(_as(_planned(max_seqlen, impl, q_proxy, k_proxy, top_k_blocks, block_size, scale, cu_seqlens,
                               **extra, **_key_offsets("select_blocks", cu_seqlens, cu_seqlens_k, seqused_k)),
                      torch.int32))


@torch.library.custom_op(f"{NAMESPACE}::select_blocks", mutates_args=())
def select_blocks(q_proxy: Tensor, k_proxy: Tensor, top_k_blocks: int, block_size: int, scale: float,
                  cu_seqlens: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                  seqused_k: Optional[Tensor] = None, precision: str = "bf16", local_blocks: int = 1,
                  max_seqlen: Optional[int] = None) -> Tensor:
    """int32 (B, Hp, S, K) selected key blocks per (b, p, i), -1 for empty slots. Not differentiable. precision
    "fp8": scores from the e4m3-quantised proxy pair (flash_msa_rt.reference.fp8). scale: the proxy scale.
    local_blocks: the L most recent blocks always selected (1 <= L <= K). max_seqlen: given, packs are planned on
    the device from it (the other ops' too; torch.compile passes it, flash_msa_rt.api)."""
    return select_blocks_body(q_proxy, k_proxy, top_k_blocks, block_size, scale, cu_seqlens, cu_seqlens_k, seqused_k,
                              precision, local_blocks, max_seqlen)


@select_blocks.register_fake
def _(q_proxy, k_proxy, top_k_blocks, block_size, scale, cu_seqlens=None, cu_seqlens_k=None, seqused_k=None,
      precision="bf16", local_blocks=1, max_seqlen=None):
    B, S, Hp, _ = q_proxy.shape
    return q_proxy.new_empty((B, Hp, S, top_k_blocks), dtype=torch.int32)


# --- MSA: sparse main attention + proxy KL -----------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::msa_forward", mutates_args=())
def msa_forward(q_proxy: Tensor, k_proxy: Tensor, q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor,
                block_size: int, scale: float, cu_seqlens: Optional[Tensor] = None,
                cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None, kl: bool = True,
                kl_metric: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                proxy_scale: Optional[float] = None,
                max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out (B, S, H, D) q.dtype, lse (B, H, S), lse_proxy (B, Hp, S), kl_rows (B, Hp, S)); statistics float32
    (float64 for float64 inputs). S counts the queries (q's dim 1). kl=False: lse_proxy and kl_rows are zeros and
    the backward forms them (writing the KL value into kl_metric, which the forward does not touch). kl=True with a
    kl_metric: the backward writes the mean of this forward's kl_rows into it. sinks (H,): out includes them, lse
    does not (lse0; the softmax's lse is logaddexp(lse, sinks)). proxy_scale: the proxy scores' (None: scale)."""
    with sparse_plan.ops_keep_no_lists():  # what the backward needs is in its saved tensors, or recomputed
        return msa_forward_body(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, cu_seqlens,
                                cu_seqlens_k, seqused_k, kl, sinks, proxy_scale, max_seqlen)


def msa_forward_body(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, cu_seqlens=None, cu_seqlens_k=None,
                     seqused_k=None, kl=True, sinks=None, proxy_scale=None, max_seqlen=None):
    """msa_forward's body (the custom op's and the eager path's)."""
    # The sinks reach the implementation, which returns out scaled by 1 - p_sink and lse0 (the kernels scale out
    # in their combine, no pass of its own; the reference around its forward: sinks.scaled_outputs); the config
    # says so, so a kernel build without the sink combine declines exactly those calls.
    config = _msa_config(q_proxy, q, k, block_size, cu_seqlens, cu_seqlens_k, proxy_scale)
    if sinks is not None:
        config["sinks"] = True
    impl = _impl("msa_forward", q, config)
    return _stats(q, *_planned(max_seqlen, impl, q_proxy, k_proxy, q, k, v, block_indices, block_size, scale,
                               cu_seqlens, **_kl_flag(kl), **_proxy_scale(proxy_scale), **_sinks_kw(sinks),
                               **_key_offsets("msa_forward", cu_seqlens, cu_seqlens_k, seqused_k)))


def _sinks_kw(sinks) -> dict:
    """sinks for an msa_forward implementation, only where given."""
    return {} if sinks is None else {"sinks": sinks}


def _msa_outputs_fake(q_proxy, q):
    B, S, H, _ = q.shape
    Hp = q_proxy.shape[2]
    f32 = stat_dtype(q.dtype)
    return (q.new_empty(q.shape), q.new_empty((B, H, S), dtype=f32), q.new_empty((B, Hp, S), dtype=f32),
            q.new_empty((B, Hp, S), dtype=f32))


@msa_forward.register_fake
def _(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, cu_seqlens=None, cu_seqlens_k=None,
      seqused_k=None, kl=True, kl_metric=None, sinks=None, proxy_scale=None, max_seqlen=None):
    return _msa_outputs_fake(q_proxy, q)


@torch.library.custom_op(f"{NAMESPACE}::msa_kl", mutates_args=())
def msa_kl(q_proxy: Tensor, k_proxy: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, block_indices: Tensor,
           block_size: int, scale: float, cu_seqlens: Optional[Tensor] = None,
           cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
           with_kl: bool = True, proxy_scale: Optional[float] = None,
           max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(lse_proxy, kl_rows) of msa_forward given its lse (lse0 with sinks): the KL pass alone (kl=False's
    backward). with_kl False: only lse_proxy is wanted (kl_rows may hold zeros), which the kernels form at ~1 / 5
    of the pass's work."""
    with sparse_plan.ops_keep_no_lists():  # as msa_forward
        return msa_kl_body(q_proxy, k_proxy, q, k, v, lse, block_indices, block_size, scale, cu_seqlens,
                           cu_seqlens_k, seqused_k, with_kl, proxy_scale, max_seqlen)


def msa_kl_body(q_proxy, k_proxy, q, k, v, lse, block_indices, block_size, scale, cu_seqlens=None, cu_seqlens_k=None,
                seqused_k=None, with_kl=True, proxy_scale=None, max_seqlen=None):
    """msa_kl's body (the custom op's and the eager path's)."""
    impl = _impl("msa_kl", q, _msa_config(q_proxy, q, k, block_size, cu_seqlens, cu_seqlens_k, proxy_scale))
    keys = dict(_key_offsets("msa_kl", cu_seqlens, cu_seqlens_k, seqused_k), **_proxy_scale(proxy_scale))
    if not with_kl:
        keys["with_kl"] = False
    return _stats_only(q, *_planned(max_seqlen, impl, q_proxy, k_proxy, q, k, v, lse, block_indices, block_size,
                                    scale, cu_seqlens, **keys))


def _kl_fake(q_proxy, q):
    return _msa_outputs_fake(q_proxy, q)[2:]


@msa_kl.register_fake
def _(q_proxy, k_proxy, q, k, v, lse, block_indices, block_size, scale, cu_seqlens=None, cu_seqlens_k=None,
      seqused_k=None, with_kl=True, proxy_scale=None, max_seqlen=None):
    return _kl_fake(q_proxy, q)


def _deferred_kl(ctx, kl_pass, grad_kl_rows, lse_proxy):
    """lse_proxy for the backward: the forward's, or (kl=False) the KL pass's, which also writes the KL value into
    the caller's kl_metric. Runs the pass only where the proxy gradient or kl_metric needs it. A forward that ran
    the pass for a value that waits (kl=True with a kl_metric: api._kl_route) left its rows in ctx.kl_rows."""
    if ctx.kl:
        if ctx.kl_metric is not None:
            ctx.kl_metric.copy_(ctx.kl_rows.sum() / max(ctx.kl_rows.numel(), 1))  # flash_msa_rt.api's kl_loss
        return lse_proxy
    if grad_kl_rows is None and ctx.kl_metric is None:
        return lse_proxy
    lse_proxy, kl_rows = kl_pass()
    if ctx.kl_metric is not None:
        ctx.kl_metric.copy_(kl_rows.sum() / max(kl_rows.numel(), 1))  # flash_msa_rt.api's kl_loss
    return lse_proxy


@torch.library.custom_op(f"{NAMESPACE}::msa_backward", mutates_args=())
def msa_backward(q_proxy: Tensor, k_proxy: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 lse_proxy: Tensor, block_indices: Tensor, block_size: int, scale: float, grad_out: Optional[Tensor],
                 kl_grad: Optional[Tensor], cu_seqlens: Optional[Tensor] = None,
                 cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                 sinks: Optional[Tensor] = None, proxy_scale: Optional[float] = None,
                 max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq_proxy, dk_proxy, dq, dk, dv). kl_grad is d(loss)/d(kl_rows), broadcastable to (B, Hp, S), or None.
    With sinks, out is msa_forward's (sink-adjusted) and lse its lse0; d sinks is the autograd rule's."""
    return msa_backward_body(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale,
                             grad_out, kl_grad, cu_seqlens, cu_seqlens_k, seqused_k, sinks, proxy_scale,
                             max_seqlen=max_seqlen)


# The backward that also writes the KL value (deferred mode) is an op of its own whose kl_metric is required:
# an optional mutated argument breaks torch 2.11's in-place bookkeeping (ADInplaceOrView indexes the arguments as
# given, so an omitted one is out of range).
@torch.library.custom_op(f"{NAMESPACE}::msa_backward_kl", mutates_args=("kl_metric",))
def msa_backward_kl(q_proxy: Tensor, k_proxy: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    lse_proxy: Tensor, block_indices: Tensor, block_size: int, scale: float,
                    grad_out: Optional[Tensor], kl_grad: Optional[Tensor], kl_metric: Tensor,
                    cu_seqlens: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                    seqused_k: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                    proxy_scale: Optional[float] = None,
                    max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """msa_backward that also writes the mean KL value into kl_metric (deferred KL mode), which the kernels form
    inside the proxy backward (a pack's calls: one mean over its real rows, packed_kl.PackKL)."""
    return msa_backward_body(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale,
                             grad_out, kl_grad, cu_seqlens, cu_seqlens_k, seqused_k, sinks, proxy_scale,
                             kl_metric=kl_metric, max_seqlen=max_seqlen)


def _msa_backward_op(*args, kl_metric=None, **bound):
    """The custom op for a backward with or without the KL value (the autograd rule's `backward`)."""
    if kl_metric is None:
        return msa_backward(*args, **bound)
    return msa_backward_kl(*args[:13], kl_metric, *args[13:], **bound)


def msa_backward_body(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
                      kl_grad, cu_seqlens=None, cu_seqlens_k=None, seqused_k=None, sinks=None, proxy_scale=None, *,
                      kl_metric=None, max_seqlen=None):
    """msa_backward's body (the custom op's and the eager path's)."""
    # The kernels' backward sums with fp32 atomics; under torch.use_deterministic_algorithms(True) dispatch
    # must be able to decline it, so the flag belongs to the problem.
    config = dict(_msa_config(q_proxy, q, k, block_size, cu_seqlens, cu_seqlens_k, proxy_scale),
                  deterministic=torch.are_deterministic_algorithms_enabled())
    impl = _impl("msa_backward", q, config)
    keys = dict(_key_offsets("msa_backward", cu_seqlens, cu_seqlens_k, seqused_k), **_proxy_scale(proxy_scale))

    def run(lse_rows, grad_out, kl_grad, metric):
        extra = dict(keys, kl_metric=metric) if metric is not None else keys
        return _planned(max_seqlen, impl, q_proxy, k_proxy, q, k, v, out, lse_rows, lse_proxy, block_indices,
                        block_size, scale, grad_out, kl_grad, cu_seqlens, **extra)

    grads = _sinks_folded(run, out, lse, sinks, grad_out, kl_grad, kl_metric)
    return _grads_like((q_proxy, k_proxy, q, k, v), grads)


def _sinks_folded(run, out, lse, sinks, grad_out, kl_grad, kl_metric) -> tuple:
    """run(lse, grad_out, kl_grad, kl_metric) -> (dq_proxy, dk_proxy, dq, dk, dv) of a backend's backward, one call
    with or without sinks. With them, lse is lse0 (the KL target's) and grad_out becomes exp(lse0 - lse) grad_out:
    flash_msa_rt.ops.sinks shows that the main gradients are then the sink-adjusted softmax's while tau stays the
    sink-free one, so the kernels' fused tau path serves both. (The autograd rules fold the sinks themselves,
    _fold_sinks, and call the backward without them; this serves a direct call of the op with sinks.)"""
    if sinks is None or grad_out is None:
        return run(lse, grad_out, kl_grad, kl_metric)
    scaled, _ = _sinks.scaled_grad_and_delta(grad_out, out, lse, _sinks.lse_with(lse, sinks))
    return run(lse, scaled, kl_grad, kl_metric)


@torch.library.custom_op(f"{NAMESPACE}::sink_rows", mutates_args=())
def sink_rows(grad_out: Tensor, out: Tensor, lse0: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """(exp(lse0 - lse) grad_out per row, delta = <grad_out, out> float32 (B, H, S)) of (B, S, H, D) grad_out and
    out: the autograd rules' sink step (flash_msa_rt.ops.sinks.scaled_grad_and_delta), one pass on the kernels."""
    return _sinks.scaled_grad_and_delta(grad_out, out, lse0, lse)


@sink_rows.register_fake
def _(grad_out, out, lse0, lse):
    B, S, H, _ = out.shape
    return torch.empty_like(grad_out), out.new_empty((B, H, S), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::sink_delta", mutates_args=())
def sink_delta(grad_out: Tensor, out: Tensor) -> Tensor:
    """delta = <grad_out, out> float32 (B, H, S) of (B, S, H, D) tensors: block-sparse attention's d sinks."""
    return _sinks.delta(out, grad_out)


@sink_delta.register_fake
def _(grad_out, out):
    B, S, H, _ = out.shape
    return out.new_empty((B, H, S), dtype=torch.float32)


@msa_backward.register_fake
def _(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out, kl_grad,
      cu_seqlens=None, cu_seqlens_k=None, seqused_k=None, sinks=None, proxy_scale=None, max_seqlen=None):
    return _fake_grads(q_proxy, k_proxy, q, k, v)


@msa_backward_kl.register_fake
def _(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out, kl_grad, kl_metric,
      cu_seqlens=None, cu_seqlens_k=None, seqused_k=None, sinks=None, proxy_scale=None, max_seqlen=None):
    return _fake_grads(q_proxy, k_proxy, q, k, v)


def _msa_setup_context(ctx, inputs, output):
    (q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, cu_seqlens, cu_seqlens_k, seqused_k, kl,
     kl_metric, sinks, proxy_scale, max_seqlen) = inputs
    out, lse, lse_proxy, kl_rows = output
    ctx.save_for_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, cu_seqlens, cu_seqlens_k,
                          seqused_k, sinks)
    ctx.block_size, ctx.scale, ctx.proxy_scale, ctx.tuning = block_size, scale, proxy_scale, tuning.current()
    ctx.max_seqlen = max_seqlen
    # kl_metric is written, not read: held as is, outside save_for_backward's version check; with kl, from the
    # forward's rows (an output of this op, which nothing else writes).
    ctx.kl, ctx.kl_metric = kl, kl_metric
    ctx.kl_rows = kl_rows if kl and kl_metric is not None else None
    ctx.mark_non_differentiable(lse, lse_proxy)
    ctx.set_materialize_grads(False)


def under_forward_tuning(ctx, gradients, *args):
    """gradients(*args) under the tuning overrides the forward ran under (ctx.tuning): autograd runs a CUDA backward
    on its own threads. Entering them only where they differ spares the common case a context switch."""
    if ctx.tuning == tuning.current():
        return gradients(*args)
    with tuning.applied(ctx.tuning):
        return gradients(*args)


def msa_gradients(ctx, grad_out, grad_kl_rows, kl_pass, backward):
    """(dq_proxy, dk_proxy, dq, dk, dv, d sinks) of an MSA forward whose ctx holds _msa_setup_context's saved
    tensors and attributes, None for a gradient that does not arrive (d sinks: None without sinks); kl_pass and
    backward: msa_kl and msa_backward, the custom ops (their autograd rule) or their bodies (the eager path)."""
    q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, cu_seqlens, cu_seqlens_k, seqused_k, sinks = \
        ctx.saved_tensors
    metric, bound = {}, _bound(getattr(ctx, "max_seqlen", None))
    if not ctx.kl and grad_kl_rows is not None and cu_seqlens_k is None:
        # The proxy gradient needs lse_proxy before the backward, the KL value (if asked for) does not: the proxy
        # lse alone here, and the backward forms the value from the tau and pi it computes anyway (on the tau
        # path; where it cannot, it runs the KL pass itself). A pack's calls hand their rows to one mean
        # (packed_kl.PackKL); separate key offsets keep the whole pass.
        lse_proxy = kl_pass(q_proxy, k_proxy, q, k, v, lse, block_indices, ctx.block_size, ctx.scale, cu_seqlens,
                            cu_seqlens_k, seqused_k, with_kl=False, proxy_scale=ctx.proxy_scale, **bound)[0]
        if ctx.kl_metric is not None:
            metric["kl_metric"] = ctx.kl_metric
    else:
        lse_proxy = _deferred_kl(ctx, lambda: kl_pass(q_proxy, k_proxy, q, k, v, lse, block_indices, ctx.block_size,
                                                      ctx.scale, cu_seqlens, cu_seqlens_k, seqused_k,
                                                      proxy_scale=ctx.proxy_scale, **bound),
                                 grad_kl_rows, lse_proxy)
    if grad_out is None and grad_kl_rows is None:
        return (None,) * 6
    grad_main, d_sinks = _fold_sinks(out, lse, grad_out, sinks)
    grads = backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, ctx.block_size, ctx.scale,
                     grad_main, grad_kl_rows, cu_seqlens, cu_seqlens_k, seqused_k, None, ctx.proxy_scale, **metric,
                     **bound)
    return _arrived(grads, grad_out, grad_kl_rows) + (d_sinks,)


def _fold_sinks(out, lse0, grad_out, sinks):
    """(the upstream gradient a sink-free backward on lse0 takes, d sinks): (grad_out, None) without sinks or
    grad_out; with them (k grad_out, d sinks) from one pass over grad_out and out (flash_msa_rt.ops.sinks), so
    the backward runs as without sinks (its fused tau path included)."""
    if sinks is None or grad_out is None:
        return grad_out, None
    lse = _sinks.lse_with(lse0, sinks)
    grad_main, delta = sink_rows(grad_out, out, lse0, lse)
    return grad_main, _sinks.sink_gradient(delta, lse, sinks)


def _msa_backward_rule(ctx, grad_out, grad_lse, grad_lse_proxy, grad_kl_rows):
    *grads, d_sinks = under_forward_tuning(ctx, msa_gradients, ctx, grad_out, grad_kl_rows, msa_kl,
                                           _msa_backward_op)
    return (*grads,) + (None,) * 8 + (d_sinks, None, None)


def _arrived(grads, grad_out, grad_kl_rows):
    """None for the gradients whose only source did not arrive (zeros autograd need not accumulate): the proxy's
    come from kl_rows only, q, k and v's from out only."""
    dq_proxy, dk_proxy, dq, dk, dv = grads
    if grad_kl_rows is None:
        dq_proxy = dk_proxy = None
    if grad_out is None:
        dq = dk = dv = None
    return dq_proxy, dk_proxy, dq, dk, dv


msa_forward.register_autograd(_msa_backward_rule, setup_context=_msa_setup_context)


# --- warmup: dense causal main attention + proxy KL over the full causal set ----------------------------------

@torch.library.custom_op(f"{NAMESPACE}::warmup_forward", mutates_args=())
def warmup_forward(q_proxy: Tensor, k_proxy: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float,
                   cu_seqlens: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                   seqused_k: Optional[Tensor] = None, kl: bool = True,
                   kl_metric: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                   proxy_scale: Optional[float] = None,
                   max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """msa_forward's outputs with every causal key allowed (no selection); kl, kl_metric, sinks (lse is lse0),
    proxy_scale and max_seqlen as msa_forward's."""
    return warmup_forward_body(q_proxy, k_proxy, q, k, v, scale, cu_seqlens, cu_seqlens_k, seqused_k, kl, sinks,
                               proxy_scale, max_seqlen)


def warmup_forward_body(q_proxy, k_proxy, q, k, v, scale, cu_seqlens=None, cu_seqlens_k=None, seqused_k=None,
                        kl=True, sinks=None, proxy_scale=None, max_seqlen=None):
    """warmup_forward's body (the custom op's and the eager path's)."""
    impl = _impl("warmup_forward", q, _msa_config(q_proxy, q, k, None, cu_seqlens, cu_seqlens_k, proxy_scale))
    keys = dict(_key_offsets("warmup_forward", cu_seqlens, cu_seqlens_k, seqused_k), **_proxy_scale(proxy_scale))
    return _sinks.scaled_outputs(_stats(q, *_planned(max_seqlen, impl, q_proxy, k_proxy, q, k, v, scale, cu_seqlens,
                                           **_kl_flag(kl), **keys)), sinks)


@warmup_forward.register_fake
def _(q_proxy, k_proxy, q, k, v, scale, cu_seqlens=None, cu_seqlens_k=None, seqused_k=None, kl=True,
      kl_metric=None, sinks=None, proxy_scale=None, max_seqlen=None):
    return _msa_outputs_fake(q_proxy, q)


@torch.library.custom_op(f"{NAMESPACE}::warmup_kl", mutates_args=())
def warmup_kl(q_proxy: Tensor, k_proxy: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, scale: float,
              cu_seqlens: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
              seqused_k: Optional[Tensor] = None, with_kl: bool = True,
              proxy_scale: Optional[float] = None, max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(lse_proxy, kl_rows) of warmup_forward given its lse (lse0): the KL pass alone (kl=False's backward). with_kl
    False: only lse_proxy is wanted (kl_rows may hold zeros), which the kernels form at ~1 / 5 of the pass's work."""
    return warmup_kl_body(q_proxy, k_proxy, q, k, v, lse, scale, cu_seqlens, cu_seqlens_k, seqused_k, with_kl,
                          proxy_scale, max_seqlen)


def warmup_kl_body(q_proxy, k_proxy, q, k, v, lse, scale, cu_seqlens=None, cu_seqlens_k=None, seqused_k=None,
                   with_kl=True, proxy_scale=None, max_seqlen=None):
    """warmup_kl's body (the custom op's and the eager path's)."""
    impl = _impl("warmup_kl", q, _msa_config(q_proxy, q, k, None, cu_seqlens, cu_seqlens_k, proxy_scale))
    keys = dict(_key_offsets("warmup_kl", cu_seqlens, cu_seqlens_k, seqused_k), **_proxy_scale(proxy_scale))
    if not with_kl:
        keys["with_kl"] = False
    return _stats_only(q, *_planned(max_seqlen, impl, q_proxy, k_proxy, q, k, v, lse, scale, cu_seqlens, **keys))


@warmup_kl.register_fake
def _(q_proxy, k_proxy, q, k, v, lse, scale, cu_seqlens=None, cu_seqlens_k=None, seqused_k=None, with_kl=True,
      proxy_scale=None, max_seqlen=None):
    return _kl_fake(q_proxy, q)


@torch.library.custom_op(f"{NAMESPACE}::warmup_backward", mutates_args=())
def warmup_backward(q_proxy: Tensor, k_proxy: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    lse_proxy: Tensor, scale: float, grad_out: Optional[Tensor], kl_grad: Optional[Tensor],
                    cu_seqlens: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                    seqused_k: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                    proxy_scale: Optional[float] = None,
                    max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq_proxy, dk_proxy, dq, dk, dv) of warmup_forward (sinks as msa_backward's)."""
    return warmup_backward_body(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, cu_seqlens,
                                cu_seqlens_k, seqused_k, sinks, proxy_scale, max_seqlen=max_seqlen)


@torch.library.custom_op(f"{NAMESPACE}::warmup_backward_kl", mutates_args=("kl_metric",))
def warmup_backward_kl(q_proxy: Tensor, k_proxy: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       lse_proxy: Tensor, scale: float, grad_out: Optional[Tensor], kl_grad: Optional[Tensor],
                       kl_metric: Tensor, cu_seqlens: Optional[Tensor] = None,
                       cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                       sinks: Optional[Tensor] = None, proxy_scale: Optional[float] = None,
                       max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """warmup_backward that also writes the mean KL value into kl_metric (deferred KL mode, one sequence), which
    the kernels form inside the proxy backward (msa_backward_kl says why it is an op of its own)."""
    return warmup_backward_body(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, cu_seqlens,
                                cu_seqlens_k, seqused_k, sinks, proxy_scale, kl_metric=kl_metric,
                                max_seqlen=max_seqlen)


def _warmup_backward_op(*args, kl_metric=None, **bound):
    """The custom op for a warmup backward with or without the KL value (the autograd rule's `backward`)."""
    if kl_metric is None:
        return warmup_backward(*args, **bound)
    return warmup_backward_kl(*args[:11], kl_metric, *args[11:], **bound)  # args: warmup_backward's, sinks included


def warmup_backward_body(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, cu_seqlens=None,
                         cu_seqlens_k=None, seqused_k=None, sinks=None, proxy_scale=None, *, kl_metric=None,
                         max_seqlen=None):
    """warmup_backward's body (the custom op's and the eager path's)."""
    config = dict(_msa_config(q_proxy, q, k, None, cu_seqlens, cu_seqlens_k, proxy_scale),
                  deterministic=torch.are_deterministic_algorithms_enabled())  # as msa_backward
    impl = _impl("warmup_backward", q, config)
    keys = dict(_key_offsets("warmup_backward", cu_seqlens, cu_seqlens_k, seqused_k), **_proxy_scale(proxy_scale))

    def run(lse_rows, grad_out, kl_grad, metric):
        extra = dict(keys, kl_metric=metric) if metric is not None else keys
        return _planned(max_seqlen, impl, q_proxy, k_proxy, q, k, v, out, lse_rows, lse_proxy, scale, grad_out,
                        kl_grad, cu_seqlens, **extra)

    grads = _sinks_folded(run, out, lse, sinks, grad_out, kl_grad, kl_metric)
    return _grads_like((q_proxy, k_proxy, q, k, v), grads)


@warmup_backward.register_fake
def _(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, cu_seqlens=None, cu_seqlens_k=None,
      seqused_k=None, sinks=None, proxy_scale=None, max_seqlen=None):
    return _fake_grads(q_proxy, k_proxy, q, k, v)


@warmup_backward_kl.register_fake
def _(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, kl_metric, cu_seqlens=None,
      cu_seqlens_k=None, seqused_k=None, sinks=None, proxy_scale=None, max_seqlen=None):
    return _fake_grads(q_proxy, k_proxy, q, k, v)


def _warmup_setup_context(ctx, inputs, output):
    (q_proxy, k_proxy, q, k, v, scale, cu_seqlens, cu_seqlens_k, seqused_k, kl, kl_metric, sinks, proxy_scale,
     max_seqlen) = inputs
    out, lse, lse_proxy, kl_rows = output
    ctx.save_for_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, cu_seqlens, cu_seqlens_k, seqused_k, sinks)
    ctx.scale, ctx.proxy_scale, ctx.tuning, ctx.max_seqlen = scale, proxy_scale, tuning.current(), max_seqlen
    ctx.kl, ctx.kl_metric = kl, kl_metric  # as _msa_setup_context
    ctx.kl_rows = kl_rows if kl and kl_metric is not None else None
    ctx.mark_non_differentiable(lse, lse_proxy)
    ctx.set_materialize_grads(False)


def warmup_gradients(ctx, grad_out, grad_kl_rows, kl_pass, backward):
    """msa_gradients of a warmup forward (_warmup_setup_context's ctx): kl_pass and backward are warmup_kl and
    warmup_backward, the custom ops or their bodies."""
    q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, cu_seqlens, cu_seqlens_k, seqused_k, sinks = ctx.saved_tensors
    metric, bound = {}, _bound(getattr(ctx, "max_seqlen", None))
    if not ctx.kl and grad_kl_rows is not None and cu_seqlens_k is None:
        # The proxy gradient needs lse_proxy before the backward, the KL value (if asked for) does not: the proxy
        # lse alone here, and the backward forms the value from the tau and pi it computes anyway (on the
        # kernels; where it cannot, it runs the KL pass itself). A pack's calls hand their rows to one mean
        # (packed_kl.PackKL); separate key offsets keep the whole pass.
        lse_proxy = kl_pass(q_proxy, k_proxy, q, k, v, lse, ctx.scale, cu_seqlens, cu_seqlens_k, seqused_k,
                            with_kl=False, proxy_scale=ctx.proxy_scale, **bound)[0]
        if ctx.kl_metric is not None:
            metric["kl_metric"] = ctx.kl_metric
    else:
        lse_proxy = _deferred_kl(ctx, lambda: kl_pass(q_proxy, k_proxy, q, k, v, lse, ctx.scale, cu_seqlens,
                                                      cu_seqlens_k, seqused_k, proxy_scale=ctx.proxy_scale, **bound),
                                 grad_kl_rows, lse_proxy)
    if grad_out is None and grad_kl_rows is None:
        return (None,) * 6
    grad_main, d_sinks = _fold_sinks(out, lse, grad_out, sinks)
    grads = backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, ctx.scale, grad_main, grad_kl_rows, cu_seqlens,
                     cu_seqlens_k, seqused_k, None, ctx.proxy_scale, **metric, **bound)
    return _arrived(grads, grad_out, grad_kl_rows) + (d_sinks,)


def _warmup_backward_rule(ctx, grad_out, grad_lse, grad_lse_proxy, grad_kl_rows):
    *grads, d_sinks = under_forward_tuning(ctx, warmup_gradients, ctx, grad_out, grad_kl_rows, warmup_kl,
                                           _warmup_backward_op)
    return (*grads,) + (None,) * 6 + (d_sinks, None, None)


warmup_forward.register_autograd(_warmup_backward_rule, setup_context=_warmup_setup_context)


# --- generic block-sparse attention ------------------------------------------------------------------------------

def _block_sparse_config(q: Tensor, k: Tensor, block_indices: Tensor, block_size: int, cu_seqlens) -> dict:
    return {"head_dim": q.shape[-1], "block_size": block_size, "heads": q.shape[2],
            "index_heads": block_indices.shape[1], "kv_group": q.shape[2] // k.shape[2],
            "varlen": cu_seqlens is not None}


@torch.library.custom_op(f"{NAMESPACE}::block_sparse_forward", mutates_args=())
def block_sparse_forward(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_size: int, scale: float,
                         cu_seqlens: Optional[Tensor] = None,
                         sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out (B, S, H, D) q.dtype, lse (B, H, S) float32 (float64 for float64 inputs)) over the causal tokens of each
    row's listed blocks. sinks (H,): both include them (a row with no allowed key: out 0, lse = sink)."""
    if cu_seqlens is not None:  # the check block_sparse_attention leaves to the op under torch.compile (a host read)
        validation.check_cu_seqlens_values("block_sparse_attention", cu_seqlens, q.shape[1])
    return block_sparse_forward_body(q, k, v, block_indices, block_size, scale, cu_seqlens, sinks)


def block_sparse_forward_body(q, k, v, block_indices, block_size, scale, cu_seqlens=None, sinks=None):
    """block_sparse_forward's body (the custom op's and the eager path's)."""
    config = _block_sparse_config(q, k, block_indices, block_size, cu_seqlens)
    out, lse0 = _stats(q, *_impl("block_sparse_forward", q, config)(q, k, v, block_indices, block_size, scale,
                                                                    cu_seqlens))
    if sinks is None:
        return out, lse0
    lse = _sinks.lse_with(lse0, sinks)  # no KL here: the sink-including lse is all the backward needs
    return _sinks.scale_out_(out, lse0, lse), lse


@block_sparse_forward.register_fake
def _(q, k, v, block_indices, block_size, scale, cu_seqlens=None, sinks=None):
    B, S, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, S), dtype=stat_dtype(q.dtype))


@torch.library.custom_op(f"{NAMESPACE}::block_sparse_backward", mutates_args=())
def block_sparse_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block_indices: Tensor,
                          block_size: int, scale: float, grad_out: Tensor,
                          cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of block_sparse_forward."""
    return block_sparse_backward_body(q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens)


def block_sparse_backward_body(q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens=None):
    """block_sparse_backward's body (the custom op's and the eager path's)."""
    config = dict(_block_sparse_config(q, k, block_indices, block_size, cu_seqlens),
                  deterministic=torch.are_deterministic_algorithms_enabled())  # as msa_backward
    impl = _impl("block_sparse_backward", q, config)
    return _grads_like((q, k, v), impl(q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens))


@block_sparse_backward.register_fake
def _(q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens=None):
    return _fake_grads(q, k, v)


def _block_sparse_setup_context(ctx, inputs, output):
    q, k, v, block_indices, block_size, scale, cu_seqlens, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, block_indices, cu_seqlens, sinks)
    ctx.block_size, ctx.scale, ctx.tuning = block_size, scale, tuning.current()
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def block_sparse_gradients(ctx, grad_out, backward):
    """(dq, dk, dv, d sinks) of a block-sparse forward (_block_sparse_setup_context's ctx), None without grad_out
    (d sinks: None without sinks); backward: block_sparse_backward, the custom op or its body. With sinks the saved
    out and lse include them, which makes the sink-free backward's dq, dk, dv exact."""
    if grad_out is None:
        return (None,) * 4
    q, k, v, out, lse, block_indices, cu_seqlens, sinks = ctx.saved_tensors
    grads = tuple(backward(q, k, v, out, lse, block_indices, ctx.block_size, ctx.scale, grad_out, cu_seqlens))
    return grads + (None if sinks is None else _sinks.sink_gradient(sink_delta(grad_out, out), lse, sinks),)


def _block_sparse_backward_rule(ctx, grad_out, grad_lse):
    *grads, d_sinks = under_forward_tuning(ctx, block_sparse_gradients, ctx, grad_out, block_sparse_backward)
    return (*grads,) + (None,) * 4 + (d_sinks,)


block_sparse_forward.register_autograd(_block_sparse_backward_rule, setup_context=_block_sparse_setup_context)
