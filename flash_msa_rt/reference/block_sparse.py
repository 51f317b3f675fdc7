"""Reference generic block-sparse attention (the NSA / FSA "selected attention" primitive)."""

from __future__ import annotations

from flash_msa_rt.reference import attention, checks
from flash_msa_rt.reference.numerics import compute_dtype


def block_sparse_forward(q, k, v, block_indices, block_size, scale, *, sinks=None):
    """-> (out (B, S, H, D) in q.dtype, lse (B, H, S)).

    block_indices (B, Hi, S, K) integer, H % Hi == 0: head h attends, causally, to the blocks listed in
    block_indices[b, h // (H / Hi), i] (-1 = empty slot, duplicates count once). A row with no allowed key gets
    out = 0 and lse = -inf. An index outside [-1, ceil(S / block_size)) raises ValueError naming it.
    lse is float32, or float64 for float64 inputs. sinks: None or (H,) sink logits: lse includes them, and a row
    with no allowed key gets out = 0, lse = sink[h].
    """
    fn = "block_sparse_attention"  # the public function this op implements: its errors name it
    B, S, H, _, _ = checks.main_dims(fn, q, k, v)
    Bs = checks.block_size(fn, block_size)
    scale = checks.scale(fn, scale)
    checks.block_indices(fn, block_indices, B, S, H, Bs)
    checks.same_device(fn, q=q, block_indices=block_indices)
    sinks = checks.sinks(fn, sinks, H, q.device)
    dt = compute_dtype(q, k, v)
    out, lse = attention.forward(*(attention.heads_first(x, dt) for x in (q, k, v)), _keys(block_indices, Bs),
                                 scale, sinks=sinks)
    return attention.seq_first(out, q.dtype), lse


def block_sparse_backward(q, k, v, out, lse, block_indices, block_size, scale, grad_out, *, sinks=None):
    """-> (dq, dk, dv) in their inputs' dtypes. grad_out (B, S, H, D) or None (zeros). With sinks (lse and out the
    forward's sink-including ones) a fourth: d sinks (H,) float32.

    Rows with no allowed key contribute nothing.
    """
    fn = "block_sparse_backward"
    B, S, H, _, D = checks.main_dims(fn, q, k, v)
    Bs = checks.block_size(fn, block_size)
    scale = checks.scale(fn, scale)
    checks.block_indices(fn, block_indices, B, S, H, Bs)
    checks.like(fn, "out", out, (B, S, H, D))
    checks.like(fn, "lse", lse, (B, H, S))
    if grad_out is not None:
        checks.like(fn, "grad_out", grad_out, (B, S, H, D))
    dt = compute_dtype(q, k, v)
    hf = [attention.heads_first(x, dt) for x in (q, k, v, out)]
    do = attention.heads_first(grad_out, dt) if grad_out is not None else None
    sinks = checks.sinks(fn, sinks, H, q.device)
    dq, dk, dv, _, _, *d_sinks = attention.backward(*hf, lse.to(dt), _keys(block_indices, Bs), scale, do,
                                                    sinks=sinks)
    grads = attention.seq_first(dq, q.dtype), attention.seq_first(dk, k.dtype), attention.seq_first(dv, v.dtype)
    return grads + tuple(g.float() for g in d_sinks)


def _keys(block_indices, Bs):
    return lambda i0, i1: attention.listed_block_keys(block_indices[:, :, i0:i1], i0, i1, Bs)
