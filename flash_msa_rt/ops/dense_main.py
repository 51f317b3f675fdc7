"""Warmup mode's main attention: dense causal attention on cuDNN, through torch's own SDPA operators.

Warmup's main attention is plain dense causal attention (msa-semantics.md, warmup mode); cuDNN's kernel runs it
at ~600 TFLOP/s on the H200, which is what issue 5 measures against. The proxy's share (the KL pass and the proxy
backward) needs the main attention's lse, which the public scaled_dot_product_attention does not return, so this
module calls the aten operators behind it:
  - aten::_scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal,
    return_debug_mask, *, scale) -> (out, logsumexp, ...), logsumexp in natural log;
  - aten::_scaled_dot_product_cudnn_attention_backward(grad_out, q, k, v, out, logsumexp, philox_seed,
    philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale).
Both are part of torch (no JIT, CUDA-graph capturable); `available()` says whether this torch has them with the
schemas above, and dispatch falls back to the sparse kernels (every causal block selected) when it does not.
GQA: k and v keep their Hk heads when cuDNN takes them; otherwise they are expanded to H heads (and dk, dv
summed back), decided once per (device, dtype, heads) on the first call.
Tensors are (B, S, heads, D) here; cuDNN takes the (B, heads, S, D) views of the same storage (no copies).
"""

from __future__ import annotations

import torch

_FWD = "_scaled_dot_product_cudnn_attention"
_BWD = "_scaled_dot_product_cudnn_attention_backward"
_FWD_ARGS = ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
             "return_debug_mask", "scale")
_BWD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
             "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale")
_gqa_ok: dict = {}  # (device index, dtype, H, Hk) -> cuDNN takes Hk < H heads as they are


def _schema_args(name: str):
    op = getattr(torch.ops.aten, name, None)
    if op is None:
        return None
    try:
        return tuple(a.name for a in op.default._schema.arguments)
    except AttributeError:
        return None


def available() -> str | None:
    """None when this torch has both cuDNN attention operators with the argument lists used here, else why not."""
    for name, want in ((_FWD, _FWD_ARGS), (_BWD, _BWD_ARGS)):
        got = _schema_args(name)
        if got != want:
            return f"torch {torch.__version__} has no aten::{name} with arguments {want} (found {got})"
    return None


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _expand(x: torch.Tensor, G: int) -> torch.Tensor:
    """(B, S, Hk, D) -> (B, S, Hk * G, D), head h reading kv head h // G."""
    return x.repeat_interleave(G, dim=2)


def _forward_heads(q, k, v, scale):
    out, lse = getattr(torch.ops.aten, _FWD)(
        _heads_first(q), _heads_first(k), _heads_first(v), None, True, 0.0, True, False, scale=scale)[:2]
    return out, lse


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """-> (out (B, S, H, D) in q.dtype, lse (B, H, S) float32): causal softmax(scale q k^T) v on cuDNN."""
    B, S, H, D = q.shape
    Hk = k.shape[2]
    key = (q.device.index, q.dtype, H, Hk)
    out = lse = None
    if Hk != H and _gqa_ok.get(key, True):
        try:
            out, lse = _forward_heads(q, k, v, scale)
            _gqa_ok[key] = True
        except RuntimeError:  # this cuDNN / torch declines GQA heads: expand below (and from now on)
            _gqa_ok[key] = False
    if out is None:
        G = H // Hk
        kx, vx = (k, v) if Hk == H else (_expand(k, G), _expand(v, G))
        out, lse = _forward_heads(q, kx, vx, scale)
    # out comes back (B, H, S, D)-shaped; return the (B, S, H, D) view (cuDNN writes it heads-strided or not)
    return out.transpose(1, 2), lse.reshape(B, H, S).float()


def dense_backward(q, k, v, out, lse, grad_out, scale):
    """-> (dq, dk, dv) in the inputs' dtypes, from dense_forward's out and lse."""
    B, S, H, D = q.shape
    Hk = k.shape[2]
    G = H // Hk
    gqa = Hk == H or _gqa_ok.get((q.device.index, q.dtype, H, Hk), False)
    kx, vx = (k, v) if gqa else (_expand(k, G), _expand(v, G))
    # cuDNN wants grad_out laid out like out.
    go = torch.empty_like(out)
    go.copy_(grad_out)
    dq, dk, dv = getattr(torch.ops.aten, _BWD)(
        _heads_first(go), _heads_first(q), _heads_first(kx), _heads_first(vx), _heads_first(out),
        lse.reshape(B, H, S, 1) if lse.dim() == 3 else lse, None, None, None, None, None, S, S, 0.0, True,
        scale=scale)
    dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
    if not gqa:
        dk = dk.unflatten(2, (Hk, G)).sum(3, dtype=torch.float32).to(k.dtype)
        dv = dv.unflatten(2, (Hk, G)).sum(3, dtype=torch.float32).to(v.dtype)
    return dq, dk, dv
