"""Reference MSA: block-sparse main attention on the proxy's selection, plus the proxy KL (forward, backward).

k, v and k_proxy may hold S_k >= S positions: the S queries are then the last S of them (query row i at position
S_k - S + i, bottom-right causal alignment) and block indices count the blocks of the S_k key positions.
"""

from __future__ import annotations

from flash_msa_rt.reference import attention, checks
from flash_msa_rt.reference.numerics import compute_dtype


def msa_forward(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, *, proxy_scale=None, sinks=None):
    """-> (out (B, S, H, D) in q.dtype, lse (B, H, S), lse_proxy (B, Hp, S), kl_rows (B, Hp, S)).

    Allowed keys of row i for every main head of proxy group p = h // (H / Hp): the causal tokens of the blocks
    listed in block_indices[b, p, i] ((B, Hp, S, K) integer, -1 = empty, duplicates count once). kl_rows[b, p, i]
    is KL_p(i) of the contract (tau = group mean of P, detached; terms with tau = 0 give 0); kl_loss is its mean.
    lse, lse_proxy and kl_rows are float32, or float64 for float64 inputs (the compute dtype).
    proxy_scale: the proxy scores' scale (None: scale). sinks: None or (H,) sink logits (msa-semantics.md,
    "Attention sinks"): lse includes them, the KL target does not.
    """
    fn = "msa_forward"
    B, S, H, _, _ = checks.main_dims(fn, q, k, v, keys_longer=True)
    S_k = k.shape[1]
    Hp, _, _ = checks.proxy_dims(fn, q_proxy, k_proxy, B, S, H, S_k)
    Bs = checks.block_size(fn, block_size)
    scale = checks.scale(fn, scale)
    proxy_scale = checks.proxy_scale(fn, proxy_scale, scale)
    sinks = checks.sinks(fn, sinks, H, q.device)
    checks.block_indices(fn, block_indices, B, S, H, Bs, heads=Hp, S_k=S_k)
    checks.same_device(fn, q=q, q_proxy=q_proxy, block_indices=block_indices)
    dt = compute_dtype(q_proxy, k_proxy, q, k, v)
    hf = [attention.heads_first(x, dt) for x in (q_proxy, k_proxy, q, k, v)]
    out, lse, lse_proxy, kl_rows = attention.forward(
        *hf[2:], _selected_keys(block_indices, Bs, S_k - S), scale, q_proxy=hf[0], k_proxy=hf[1],
        proxy_scale=proxy_scale, sinks=sinks)
    return attention.seq_first(out, q.dtype), lse, lse_proxy, kl_rows


def msa_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
                 kl_grad, *, proxy_scale=None, sinks=None):
    """-> (dq_proxy, dk_proxy, dq, dk, dv), each in its input's dtype; with sinks a sixth, d sinks (H,) float32.

    out, lse, lse_proxy: msa_forward's outputs. grad_out (B, S, H, D) or None (zero main gradients).
    kl_grad: upstream gradient of each KL_p(i), a tensor broadcastable to (B, Hp, S) (usually 0-dim: the upstream
    grad of kl_loss divided by B * Hp * S), or None (zero proxy gradients). The KL target tau is detached, so the
    KL reaches only the proxy and grad_out only q, k, v. proxy_scale and sinks as msa_forward's (lse, out: its
    sink-including outputs).
    """
    fn = "msa_backward"
    B, S, H, _, _ = checks.main_dims(fn, q, k, v, keys_longer=True)
    S_k = k.shape[1]
    Hp, _, _ = checks.proxy_dims(fn, q_proxy, k_proxy, B, S, H, S_k)
    Bs = checks.block_size(fn, block_size)
    scale = checks.scale(fn, scale)
    checks.block_indices(fn, block_indices, B, S, H, Bs, heads=Hp, S_k=S_k)
    dt = compute_dtype(q_proxy, k_proxy, q, k, v)
    return attention.proxied_backward(fn, q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, grad_out, kl_grad,
                                      scale, dt, _selected_keys(block_indices, Bs, S_k - S),
                                      checks.proxy_scale(fn, proxy_scale, scale), sinks)


def _selected_keys(block_indices, Bs, offset):
    return lambda i0, i1: attention.listed_block_keys(block_indices[:, :, i0:i1], i0, i1, Bs, offset)
