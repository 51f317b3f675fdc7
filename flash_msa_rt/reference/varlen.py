"""Varlen (packed sequences) references: every op run per sequence and concatenated along S.

Tensors have B == 1 and S == total_tokens; cu_seqlens (N + 1,) int32/int64 with cu_seqlens[0] = 0, non-decreasing,
cu_seqlens[-1] = total_tokens. Sequence s is tokens [cu[s], cu[s + 1]): causal within itself, its key blocks aligned
to its own start, block indices relative to it, a partial last block of its own. Empty sequences contribute nothing.

Argument order: the non-varlen function's, with cu_seqlens inserted right after the last argument that carries the
S dimension (block_indices in the forwards, grad_out in the backwards). Passing it by keyword is safest.
"""

from __future__ import annotations

import torch

from flash_msa_rt.reference import checks
from flash_msa_rt.reference.block_sparse import block_sparse_backward, block_sparse_forward
from flash_msa_rt.reference.msa import msa_backward, msa_forward
from flash_msa_rt.reference.numerics import compute_dtype
from flash_msa_rt.reference.selection import select_blocks
from flash_msa_rt.reference.warmup import warmup_backward, warmup_forward


def select_blocks_varlen(q_proxy, k_proxy, cu_seqlens, top_k_blocks, block_size, scale):
    """select_blocks per sequence -> int32 (1, Hp, total, K), block indices relative to each sequence.

    Order: (q_proxy, k_proxy, cu_seqlens, top_k_blocks, block_size, scale).
    """
    fn = "select_blocks_varlen"
    seqs = _sequences(fn, cu_seqlens, q_proxy, k_proxy)
    K = checks.top_k_blocks(fn, top_k_blocks)
    checks.block_size(fn, block_size)
    checks.scale(fn, scale)
    out = torch.full((1, q_proxy.shape[2], q_proxy.shape[1], K), -1, dtype=torch.int32, device=q_proxy.device)
    for a, b in seqs:
        out[:, :, a:b] = select_blocks(q_proxy[:, a:b], k_proxy[:, a:b], K, block_size, scale)
    return out


def msa_forward_varlen(q_proxy, k_proxy, q, k, v, block_indices, cu_seqlens, block_size, scale):
    """msa_forward per sequence -> (out (1, total, H, D), lse (1, H, total), lse_proxy, kl_rows (1, Hp, total)).

    Order: (q_proxy, k_proxy, q, k, v, block_indices, cu_seqlens, block_size, scale); block_indices
    (1, Hp, total, K) relative to each sequence. kl_loss = kl_rows.sum() / (Hp * total).
    """
    seqs = _sequences("msa_forward_varlen", cu_seqlens, q_proxy, k_proxy, q, k, v, block_indices)
    res = _forward_outputs(q_proxy, q, compute_dtype(q_proxy, k_proxy, q, k, v))
    for a, b in seqs:
        parts = msa_forward(q_proxy[:, a:b], k_proxy[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b],
                            block_indices[:, :, a:b], block_size, scale)
        _place(res, parts, a, b)
    return tuple(res)


def msa_backward_varlen(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
                        cu_seqlens, kl_grad):
    """msa_backward per sequence -> (dq_proxy, dk_proxy, dq, dk, dv).

    Order: (q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
    cu_seqlens, kl_grad). kl_grad broadcastable to (1, Hp, total) or None; grad_out (1, total, H, D) or None.
    """
    fn = "msa_backward_varlen"
    seqs = _sequences(fn, cu_seqlens, q_proxy, k_proxy, q, k, v, out, grad_out)
    w = _kl_weights(fn, kl_grad, q_proxy)
    grads = [torch.zeros_like(x) for x in (q_proxy, k_proxy, q, k, v)]
    for a, b in seqs:
        parts = msa_backward(q_proxy[:, a:b], k_proxy[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b], out[:, a:b],
                             lse[:, :, a:b], lse_proxy[:, :, a:b], block_indices[:, :, a:b], block_size, scale,
                             _rows(grad_out, a, b), None if w is None else w[:, :, a:b])
        for g, part in zip(grads, parts):
            g[:, a:b] = part
    return tuple(grads)


def warmup_forward_varlen(q_proxy, k_proxy, q, k, v, cu_seqlens, scale):
    """warmup_forward per sequence. Order: (q_proxy, k_proxy, q, k, v, cu_seqlens, scale)."""
    seqs = _sequences("warmup_forward_varlen", cu_seqlens, q_proxy, k_proxy, q, k, v)
    res = _forward_outputs(q_proxy, q, compute_dtype(q_proxy, k_proxy, q, k, v))
    for a, b in seqs:
        _place(res, warmup_forward(q_proxy[:, a:b], k_proxy[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b], scale), a, b)
    return tuple(res)


def warmup_backward_varlen(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, cu_seqlens, kl_grad):
    """warmup_backward per sequence.

    Order: (q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, cu_seqlens, kl_grad).
    """
    fn = "warmup_backward_varlen"
    seqs = _sequences(fn, cu_seqlens, q_proxy, k_proxy, q, k, v, out, grad_out)
    w = _kl_weights(fn, kl_grad, q_proxy)
    grads = [torch.zeros_like(x) for x in (q_proxy, k_proxy, q, k, v)]
    for a, b in seqs:
        parts = warmup_backward(q_proxy[:, a:b], k_proxy[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b], out[:, a:b],
                                lse[:, :, a:b], lse_proxy[:, :, a:b], scale, _rows(grad_out, a, b),
                                None if w is None else w[:, :, a:b])
        for g, part in zip(grads, parts):
            g[:, a:b] = part
    return tuple(grads)


def block_sparse_forward_varlen(q, k, v, block_indices, cu_seqlens, block_size, scale):
    """block_sparse_forward per sequence -> (out (1, total, H, D), lse (1, H, total)).

    Order: (q, k, v, block_indices, cu_seqlens, block_size, scale); block_indices (1, Hi, total, K).
    """
    seqs = _sequences("block_sparse_forward_varlen", cu_seqlens, q, k, v, block_indices)
    B, S, H, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((B, H, S), float("-inf"), dtype=compute_dtype(q, k, v), device=q.device)
    for a, b in seqs:
        out[:, a:b], lse[:, :, a:b] = block_sparse_forward(q[:, a:b], k[:, a:b], v[:, a:b],
                                                           block_indices[:, :, a:b], block_size, scale)
    return out, lse


def block_sparse_backward_varlen(q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens):
    """block_sparse_backward per sequence -> (dq, dk, dv).

    Order: (q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens).
    """
    seqs = _sequences("block_sparse_backward_varlen", cu_seqlens, q, k, v, out, grad_out)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for a, b in seqs:
        parts = block_sparse_backward(q[:, a:b], k[:, a:b], v[:, a:b], out[:, a:b], lse[:, :, a:b],
                                      block_indices[:, :, a:b], block_size, scale, _rows(grad_out, a, b))
        for g, part in zip(grads, parts):
            g[:, a:b] = part
    return tuple(grads)


def _sequences(fn: str, cu_seqlens, *tensors) -> list[tuple[int, int]]:
    """Validate cu_seqlens against the packed tensors -> the non-empty sequences' [start, end)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{fn}: cu_seqlens must be 1-D int32/int64 (num_seqs + 1,), got {cu_seqlens.dtype} "
                         f"shape {tuple(cu_seqlens.shape)}")
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 4:
        raise ValueError(f"{fn}: packed tensors must be (1, total_tokens, heads, D)")
    total = first.shape[1]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.shape[0] != 1:
            raise ValueError(f"{fn}: varlen tensors have B == 1 (tokens packed along S), got shape {tuple(t.shape)}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{fn}: cu_seqlens = {cu} must start at 0, never decrease and end at total_tokens = "
                         f"{total}")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def _forward_outputs(q_proxy, q, dt):
    B, S, H, _ = q.shape
    Hp = q_proxy.shape[2]
    return [torch.zeros_like(q), torch.full((B, H, S), float("-inf"), dtype=dt, device=q.device),
            torch.full((B, Hp, S), float("-inf"), dtype=dt, device=q.device),
            torch.zeros((B, Hp, S), dtype=dt, device=q.device)]


def _place(res, parts, a, b):
    out, lse, lse_proxy, kl_rows = parts
    res[0][:, a:b] = out
    res[1][:, :, a:b] = lse
    res[2][:, :, a:b] = lse_proxy
    res[3][:, :, a:b] = kl_rows


def _rows(x, a, b):
    return None if x is None else x[:, a:b]


def _kl_weights(fn, kl_grad, q_proxy):
    return checks.kl_weights(fn, kl_grad, (1, q_proxy.shape[2], q_proxy.shape[1]), torch.float64, q_proxy.device)
