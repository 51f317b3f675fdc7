"""Reference warmup mode: dense causal main attention, proxy KL over the full causal set (no selection).

k, v and k_proxy may hold S_k >= S positions: the S queries are then the last S of them (bottom-right causal).
"""

from __future__ import annotations

from flash_msa_rt.reference import attention, checks
from flash_msa_rt.reference.numerics import compute_dtype


def warmup_forward(q_proxy, k_proxy, q, k, v, scale, *, proxy_scale=None, sinks=None):
    """-> (out (B, S, H, D) in q.dtype, lse (B, H, S), lse_proxy (B, Hp, S), kl_rows (B, Hp, S)).

    As msa_forward with every causal key allowed: A_h(i) = T = {t <= i}. lse, lse_proxy and kl_rows are float32,
    or float64 for float64 inputs. proxy_scale and sinks as msa_forward's.
    """
    fn = "warmup_forward"
    B, S, H, _, _ = checks.main_dims(fn, q, k, v, keys_longer=True)
    checks.proxy_dims(fn, q_proxy, k_proxy, B, S, H, k.shape[1])
    scale = checks.scale(fn, scale)
    proxy_scale = checks.proxy_scale(fn, proxy_scale, scale)
    sinks = checks.sinks(fn, sinks, H, q.device)
    checks.same_device(fn, q=q, q_proxy=q_proxy)
    dt = compute_dtype(q_proxy, k_proxy, q, k, v)
    hf = [attention.heads_first(x, dt) for x in (q_proxy, k_proxy, q, k, v)]
    out, lse, lse_proxy, kl_rows = attention.forward(
        *hf[2:], _causal_keys(q.device, k.shape[1] - S), scale, q_proxy=hf[0], k_proxy=hf[1],
        proxy_scale=proxy_scale, sinks=sinks)
    return attention.seq_first(out, q.dtype), lse, lse_proxy, kl_rows


def warmup_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, *, proxy_scale=None,
                    sinks=None):
    """-> (dq_proxy, dk_proxy, dq, dk, dv), each in its input's dtype (with sinks, d sinks sixth); arguments as
    msa_backward's."""
    fn = "warmup_backward"
    B, S, H, _, _ = checks.main_dims(fn, q, k, v, keys_longer=True)
    checks.proxy_dims(fn, q_proxy, k_proxy, B, S, H, k.shape[1])
    scale = checks.scale(fn, scale)
    dt = compute_dtype(q_proxy, k_proxy, q, k, v)
    return attention.proxied_backward(fn, q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, grad_out, kl_grad,
                                      scale, dt, _causal_keys(q.device, k.shape[1] - S),
                                      checks.proxy_scale(fn, proxy_scale, scale), sinks)


def _causal_keys(device, offset):
    return lambda i0, i1: attention.causal_keys(i0, i1, device, offset)
