"""Varlen (packed sequences) references: every op run per sequence and concatenated along S.

Tensors have B == 1 and S == total_tokens; cu_seqlens (N + 1,) int32/int64 with cu_seqlens[0] = 0, non-decreasing,
cu_seqlens[-1] = total_tokens. Sequence s is tokens [cu[s], cu[s + 1]): causal within itself, its key blocks aligned
to its own start, block indices relative to it, a partial last block of its own. Empty sequences contribute nothing.

Separate query and key lengths (select, MSA and warmup; FlashAttention's cu_seqlens_q / cu_seqlens_k): with the
keyword-only cu_seqlens_k, cu_seqlens splits the queries (q_proxy, q and the per-query tensors) and cu_seqlens_k
the keys (k_proxy, k, v): sequence s has L_q(s) = cu[s + 1] - cu[s] queries and L_k(s) keys starting at
cu_k[s], L_q(s) <= L_k(s), its queries being the last L_q(s) of its L_k(s) positions (bottom-right causal). With
seqused_k (int (N,), only with cu_seqlens_k), L_k(s) = seqused_k[s] and the keys of sequence s are
[cu_k[s], cu_k[s] + seqused_k[s]): key ranges of different sequences may overlap (two query chunks of one
sequence reading one gathered key tensor), and the key gradients are the sums over every sequence reading a key.
cu_seqlens_k is then non-decreasing from 0 to total_k as without seqused_k, each cu_k[s] + seqused_k[s] <= total_k.

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


def select_blocks_varlen(q_proxy, k_proxy, cu_seqlens, top_k_blocks, block_size, scale, *, cu_seqlens_k=None,
                         seqused_k=None, precision="bf16", local_blocks=1):
    """select_blocks per sequence -> int32 (1, Hp, total_q, K), block indices relative to each sequence's keys.

    Order: (q_proxy, k_proxy, cu_seqlens, top_k_blocks, block_size, scale, *, cu_seqlens_k, seqused_k, precision).
    fp8 precision quantises each sequence's keys by its own key blocks (the block grid restarts per sequence).
    """
    fn = "select_blocks_varlen"
    seqs = _sequences(fn, cu_seqlens, [q_proxy], [k_proxy], cu_seqlens_k, seqused_k)
    K = checks.top_k_blocks(fn, top_k_blocks)
    checks.block_size(fn, block_size)
    checks.scale(fn, scale)
    out = torch.full((1, q_proxy.shape[2], q_proxy.shape[1], K), -1, dtype=torch.int32, device=q_proxy.device)
    for (a, b), (ka, kb) in seqs:
        out[:, :, a:b] = select_blocks(q_proxy[:, a:b], k_proxy[:, ka:kb], K, block_size, scale, precision,
                                       local_blocks)
    return out


def msa_forward_varlen(q_proxy, k_proxy, q, k, v, block_indices, cu_seqlens, block_size, scale, *,
                       cu_seqlens_k=None, seqused_k=None, proxy_scale=None, sinks=None):
    """msa_forward per sequence -> (out (1, total, H, D), lse (1, H, total), lse_proxy, kl_rows (1, Hp, total)).

    Order: (q_proxy, k_proxy, q, k, v, block_indices, cu_seqlens, block_size, scale, *, cu_seqlens_k, seqused_k);
    block_indices (1, Hp, total, K) relative to each sequence. kl_loss = kl_rows.sum() / (Hp * total), total the
    query tokens.
    """
    seqs = _sequences("msa_forward_varlen", cu_seqlens, [q_proxy, q, block_indices], [k_proxy, k, v], cu_seqlens_k,
                      seqused_k)
    res = _forward_outputs(q_proxy, q, compute_dtype(q_proxy, k_proxy, q, k, v))
    for (a, b), (ka, kb) in seqs:
        parts = msa_forward(q_proxy[:, a:b], k_proxy[:, ka:kb], q[:, a:b], k[:, ka:kb], v[:, ka:kb],
                            block_indices[:, :, a:b], block_size, scale, proxy_scale=proxy_scale, sinks=sinks)
        _place(res, parts, a, b)
    return tuple(res)


def msa_backward_varlen(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
                        cu_seqlens, kl_grad, *, cu_seqlens_k=None, seqused_k=None, proxy_scale=None, sinks=None):
    """msa_backward per sequence -> (dq_proxy, dk_proxy, dq, dk, dv).

    Order: (q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
    cu_seqlens, kl_grad, *, cu_seqlens_k, seqused_k). kl_grad broadcastable to (1, Hp, total) or None; grad_out
    (1, total, H, D) or None.
    """
    fn = "msa_backward_varlen"
    seqs = _sequences(fn, cu_seqlens, [q_proxy, q, out, grad_out], [k_proxy, k, v], cu_seqlens_k, seqused_k)
    w = _kl_weights(fn, kl_grad, q_proxy)
    grads = _zero_grads((q_proxy, k_proxy, q, k, v), sinks)
    for (a, b), (ka, kb) in seqs:
        parts = msa_backward(q_proxy[:, a:b], k_proxy[:, ka:kb], q[:, a:b], k[:, ka:kb], v[:, ka:kb], out[:, a:b],
                             lse[:, :, a:b], lse_proxy[:, :, a:b], block_indices[:, :, a:b], block_size, scale,
                             _rows(grad_out, a, b), None if w is None else w[:, :, a:b], proxy_scale=proxy_scale,
                             sinks=sinks)
        _gather(grads, parts, a, b, ka, kb)
    return tuple(grads)


def warmup_forward_varlen(q_proxy, k_proxy, q, k, v, cu_seqlens, scale, *, cu_seqlens_k=None, seqused_k=None,
                          proxy_scale=None, sinks=None):
    """warmup_forward per sequence. Order: (q_proxy, k_proxy, q, k, v, cu_seqlens, scale, *, cu_seqlens_k,
    seqused_k)."""
    seqs = _sequences("warmup_forward_varlen", cu_seqlens, [q_proxy, q], [k_proxy, k, v], cu_seqlens_k, seqused_k)
    res = _forward_outputs(q_proxy, q, compute_dtype(q_proxy, k_proxy, q, k, v))
    for (a, b), (ka, kb) in seqs:
        _place(res, warmup_forward(q_proxy[:, a:b], k_proxy[:, ka:kb], q[:, a:b], k[:, ka:kb], v[:, ka:kb], scale,
                                   proxy_scale=proxy_scale, sinks=sinks), a, b)
    return tuple(res)


def warmup_backward_varlen(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, cu_seqlens, kl_grad, *,
                           cu_seqlens_k=None, seqused_k=None, proxy_scale=None, sinks=None):
    """warmup_backward per sequence.

    Order: (q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, cu_seqlens, kl_grad, *,
    cu_seqlens_k, seqused_k).
    """
    fn = "warmup_backward_varlen"
    seqs = _sequences(fn, cu_seqlens, [q_proxy, q, out, grad_out], [k_proxy, k, v], cu_seqlens_k, seqused_k)
    w = _kl_weights(fn, kl_grad, q_proxy)
    grads = _zero_grads((q_proxy, k_proxy, q, k, v), sinks)
    for (a, b), (ka, kb) in seqs:
        parts = warmup_backward(q_proxy[:, a:b], k_proxy[:, ka:kb], q[:, a:b], k[:, ka:kb], v[:, ka:kb],
                                out[:, a:b], lse[:, :, a:b], lse_proxy[:, :, a:b], scale, _rows(grad_out, a, b),
                                None if w is None else w[:, :, a:b], proxy_scale=proxy_scale, sinks=sinks)
        _gather(grads, parts, a, b, ka, kb)
    return tuple(grads)


def block_sparse_forward_varlen(q, k, v, block_indices, cu_seqlens, block_size, scale, *, sinks=None):
    """block_sparse_forward per sequence -> (out (1, total, H, D), lse (1, H, total)).

    Order: (q, k, v, block_indices, cu_seqlens, block_size, scale); block_indices (1, Hi, total, K).
    """
    seqs = _spans("block_sparse_forward_varlen", cu_seqlens, q, k, v, block_indices)
    B, S, H, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((B, H, S), float("-inf"), dtype=compute_dtype(q, k, v), device=q.device)
    for a, b in seqs:
        out[:, a:b], lse[:, :, a:b] = block_sparse_forward(q[:, a:b], k[:, a:b], v[:, a:b],
                                                           block_indices[:, :, a:b], block_size, scale, sinks=sinks)
    return out, lse


def block_sparse_backward_varlen(q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens, *,
                                 sinks=None):
    """block_sparse_backward per sequence -> (dq, dk, dv).

    Order: (q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens).
    """
    seqs = _spans("block_sparse_backward_varlen", cu_seqlens, q, k, v, out, grad_out)
    grads = _zero_grads((q, k, v), sinks)
    for a, b in seqs:
        parts = block_sparse_backward(q[:, a:b], k[:, a:b], v[:, a:b], out[:, a:b], lse[:, :, a:b],
                                      block_indices[:, :, a:b], block_size, scale, _rows(grad_out, a, b),
                                      sinks=sinks)
        for g, part in zip(grads[:3], parts):
            g[:, a:b] = part
        if sinks is not None:
            grads[3] += parts[3]
    return tuple(grads)


def _spans(fn: str, cu_seqlens, *tensors) -> list[tuple[int, int]]:
    """Validate cu_seqlens against the packed tensors -> the non-empty sequences' [start, end)."""
    return [(a, b) for a, b in zip(*_offsets(fn, "cu_seqlens", cu_seqlens, tensors)) if b > a]


def _offsets(fn: str, name: str, cu, tensors) -> tuple[list[int], list[int]]:
    """Validate offsets `name` against the packed tensors (their dim 1) -> (starts, ends) per sequence."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{fn}: {name} must be 1-D int32/int64 (num_seqs + 1,), got {cu.dtype} "
                         f"shape {tuple(cu.shape)}")
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 4:
        raise ValueError(f"{fn}: packed tensors must be (1, total_tokens, heads, D)")
    total = first.shape[1]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.shape[0] != 1:
            raise ValueError(f"{fn}: varlen tensors have B == 1 (tokens packed along S), got shape {tuple(t.shape)}")
    offs = [int(x) for x in cu.tolist()]
    if offs[0] != 0 or offs[-1] != total or any(b < a for a, b in zip(offs, offs[1:])):
        raise ValueError(f"{fn}: {name} = {offs} must start at 0, never decrease and end at total_tokens = "
                         f"{total}")
    return offs[:-1], offs[1:]


def _sequences(fn: str, cu_seqlens, q_like, k_like, cu_seqlens_k=None, seqused_k=None):
    """Validate the offsets -> ((q_start, q_end), (k_start, k_end)) of each sequence with queries.

    q_like: tensors packed along the queries (dim 1 holds total_q), k_like along the keys. Without cu_seqlens_k
    both follow cu_seqlens.
    """
    if cu_seqlens_k is None:
        if seqused_k is not None:
            raise ValueError(f"{fn}: seqused_k needs cu_seqlens_k (the key start of each sequence)")
        return [(s, s) for s in _spans(fn, cu_seqlens, *q_like, *k_like)]
    q_starts, q_ends = _offsets(fn, "cu_seqlens", cu_seqlens, q_like)
    k_starts, k_ends = _offsets(fn, "cu_seqlens_k", cu_seqlens_k, k_like)
    if len(k_starts) != len(q_starts):
        raise ValueError(f"{fn}: cu_seqlens_k has {len(k_starts) + 1} entries but cu_seqlens has "
                         f"{len(q_starts) + 1}; both are (num_seqs + 1,)")
    if seqused_k is not None:
        total_k = k_like[0].shape[1]
        if not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype not in (torch.int32, torch.int64) \
                or tuple(seqused_k.shape) != (len(k_starts),):
            raise ValueError(f"{fn}: seqused_k must be an int32/int64 tensor (num_seqs,) = ({len(k_starts)},), got "
                             f"{seqused_k!r}")
        used = [int(x) for x in seqused_k.tolist()]
        for s, (a, n) in enumerate(zip(k_starts, used)):
            if n < 0 or a + n > total_k:
                raise ValueError(f"{fn}: sequence {s} uses keys [{a}, {a + n}) (cu_seqlens_k[{s}] = {a}, "
                                 f"seqused_k[{s}] = {n}), outside the {total_k} keys")
        k_ends = [a + n for a, n in zip(k_starts, used)]
    seqs = []
    for s, (a, b, ka, kb) in enumerate(zip(q_starts, q_ends, k_starts, k_ends)):
        if b - a > kb - ka:
            raise ValueError(f"{fn}: sequence {s} has L_q = {b - a} queries but L_k = {kb - ka} keys; L_q <= L_k "
                             f"is required (the queries are the last L_q of the L_k positions)")
        if b > a:
            seqs.append(((a, b), (ka, kb)))
    return seqs


def _zero_grads(inputs, sinks) -> list:
    """Zero gradients of inputs, and of the sinks (float32 (H,)) where given: each sequence adds its share."""
    grads = [torch.zeros_like(x) for x in inputs]
    return grads if sinks is None else grads + [torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)]


def _gather(grads, parts, a, b, ka, kb):
    """Place one sequence's (dq_proxy, dk_proxy, dq, dk, dv[, d sinks]): query gradients into its query rows, key
    gradients added into its key rows (sequences whose key ranges overlap, under seqused_k, share keys), d sinks
    summed."""
    dqp, dkp, dq, dk, dv, *d_sinks = parts
    for d in d_sinks:
        grads[5] += d
    grads[0][:, a:b] = dqp
    grads[2][:, a:b] = dq
    for g, part in ((grads[1], dkp), (grads[3], dk), (grads[4], dv)):
        g[:, ka:kb] += part


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
