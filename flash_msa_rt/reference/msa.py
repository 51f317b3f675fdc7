"""Reference MSA: block-sparse main attention on the proxy's selection, plus the proxy KL (forward, backward)."""

from __future__ import annotations

import torch

from flash_msa_rt.reference import attention, checks
from flash_msa_rt.reference.numerics import compute_dtype


def msa_forward(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale):
    """-> (out (B, S, H, D) in q.dtype, lse (B, H, S), lse_proxy (B, Hp, S), kl_rows (B, Hp, S)).

    Allowed keys of row i for every main head of proxy group p = h // (H / Hp): the causal tokens of the blocks
    listed in block_indices[b, p, i] ((B, Hp, S, K) integer, -1 = empty, duplicates count once). kl_rows[b, p, i]
    is KL_p(i) of the contract (tau = group mean of P, detached; terms with tau = 0 give 0); kl_loss is its mean.
    lse, lse_proxy and kl_rows are float32, or float64 for float64 inputs (the compute dtype).
    """
    fn = "msa_forward"
    B, S, H, _, _ = checks.main_dims(fn, q, k, v)
    Hp, _, _ = checks.proxy_dims(fn, q_proxy, k_proxy, B, S, H)
    Bs = checks.block_size(fn, block_size)
    scale = checks.scale(fn, scale)
    checks.block_indices(fn, block_indices, B, S, H, Bs, heads=Hp)
    checks.same_device(fn, q=q, q_proxy=q_proxy, block_indices=block_indices)
    dt = compute_dtype(q_proxy, k_proxy, q, k, v)
    hf = [attention.heads_first(x, dt) for x in (q_proxy, k_proxy, q, k, v)]
    out, lse, lse_proxy, kl_rows = attention.forward(
        *hf[2:], _selected_keys(block_indices, Bs), scale, q_proxy=hf[0], k_proxy=hf[1])
    return attention.seq_first(out, q.dtype), lse, lse_proxy, kl_rows


def msa_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
                 kl_grad):
    """-> (dq_proxy, dk_proxy, dq, dk, dv), each in its input's dtype.

    out, lse, lse_proxy: msa_forward's outputs. grad_out (B, S, H, D) or None (zero main gradients).
    kl_grad: upstream gradient of each KL_p(i), a tensor broadcastable to (B, Hp, S) (usually 0-dim: the upstream
    grad of kl_loss divided by B * Hp * S), or None (zero proxy gradients). The KL target tau is detached, so the
    KL reaches only the proxy and grad_out only q, k, v.
    """
    fn = "msa_backward"
    B, S, H, _, D = checks.main_dims(fn, q, k, v)
    Hp, _, _ = checks.proxy_dims(fn, q_proxy, k_proxy, B, S, H)
    Bs = checks.block_size(fn, block_size)
    scale = checks.scale(fn, scale)
    checks.block_indices(fn, block_indices, B, S, H, Bs, heads=Hp)
    dt = compute_dtype(q_proxy, k_proxy, q, k, v)
    grads = _backward(fn, q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, grad_out, kl_grad, scale, dt,
                      _selected_keys(block_indices, Bs))
    return grads


def _selected_keys(block_indices, Bs):
    return lambda i0, i1: attention.listed_block_keys(block_indices[:, :, i0:i1], i0, i1, Bs)


def _backward(fn, q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, grad_out, kl_grad, scale, dt, keys_of_rows):
    """Shared by MSA and warmup: validate the saved tensors, run attention.backward, cast the gradients back."""
    B, S, H, D = q.shape
    Hp = q_proxy.shape[2]
    checks.like(fn, "out", out, (B, S, H, D))
    checks.like(fn, "lse", lse, (B, H, S))
    checks.like(fn, "lse_proxy", lse_proxy, (B, Hp, S))
    if grad_out is not None:
        checks.like(fn, "grad_out", grad_out, (B, S, H, D))
    weights = checks.kl_weights(fn, kl_grad, (B, Hp, S), dt, q.device)
    hf = [attention.heads_first(x, dt) for x in (q_proxy, k_proxy, q, k, v, out)]
    do = attention.heads_first(grad_out, dt) if grad_out is not None else None
    dq, dk, dv, dqp, dkp = attention.backward(
        *hf[2:], lse.to(dt), keys_of_rows, scale, do,
        q_proxy=hf[0], k_proxy=hf[1], lse_proxy=lse_proxy.to(dt), kl_weights=weights)
    return (attention.seq_first(dqp, q_proxy.dtype), attention.seq_first(dkp, k_proxy.dtype),
            attention.seq_first(dq, q.dtype), attention.seq_first(dk, k.dtype), attention.seq_first(dv, v.dtype))
