"""Chunked masked attention and the proxy KL, shared by the MSA, warmup and block-sparse references.

Everything but proxied_backward is heads-first in the compute dtype: q (B, H, S, D), k and v (B, Hk, S, D),
q_proxy (B, Hp, S, Dp), k_proxy (B, Hpk, S, Dp). Head h reads key head h // (H / Hk) (the same grouping for proxy heads).

Keys may outnumber queries: with S_q query rows and S_k >= S_q key positions, query row i sits at position
i + (S_k - S_q) (bottom-right causal alignment, FlashAttention's convention for separate query / key lengths);
S_q == S_k is the usual case. Query rows are processed in chunks [i0, i1) that score only the causal prefix
[0, off + i1), off = S_k - S_q: one chunk holds about chunk_budget() scores per tensor, so no S x S tensor ever
exists. `keys_of_rows(i0, i1)` gives the chunk's allowed keys: bool (B or 1, Hi, rows, off + i1), Hi mask heads
each serving a contiguous group of H / Hi heads.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch

from flash_msa_rt.reference import checks
from flash_msa_rt.reference.numerics import _ieee_fp32_matmul, empty_rows_zero, nan_where, probabilities, without_nan

# Scores per chunk and per live tensor (a handful are live at once): 2**24 fp32 = 64 MiB. Scoped, not global:
# tests ask for small chunks inside `with chunked_by(n):` (the result must not depend on it).
_chunk_elems = contextvars.ContextVar("flash_msa_reference_chunk_elems", default=1 << 24)

KeysOfRows = Callable[[int, int], torch.Tensor]


@contextlib.contextmanager
def chunked_by(elems: int):
    """Within the block (this thread / task only), chunks hold about `elems` scores per tensor."""
    token = _chunk_elems.set(int(elems))
    try:
        yield
    finally:
        _chunk_elems.reset(token)


def row_chunks(S: int, elems_per_row: int):
    """Query-row ranges [i0, i1) covering [0, S), each at most chunk_elems // elems_per_row rows (>= 1)."""
    rows = max(1, min(S, _chunk_elems.get() // max(1, elems_per_row)))
    for i0 in range(0, S, rows):
        yield i0, min(S, i0 + rows)


def heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, heads, D) -> (B, heads, S, D) contiguous, in dtype."""
    return x.to(dtype).transpose(1, 2).contiguous()


def seq_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, heads, S, D) -> (B, S, heads, D) contiguous, in dtype."""
    return x.transpose(1, 2).to(dtype).contiguous()


def causal_keys(i0: int, i1: int, device, offset: int = 0) -> torch.Tensor:
    """(1, 1, rows, offset + i1): key t is allowed to row i (at position offset + i) iff t <= offset + i."""
    i = torch.arange(offset + i0, offset + i1, device=device).view(-1, 1)
    t = torch.arange(0, offset + i1, device=device).view(1, -1)
    return (t <= i).view(1, 1, i1 - i0, offset + i1)


def listed_block_keys(idx_rows: torch.Tensor, i0: int, i1: int, block_size: int, offset: int = 0) -> torch.Tensor:
    """(B, Hi, rows, offset + i1): key t is allowed to row i iff blk(t) is one of row i's slots and t <= offset + i.

    idx_rows: (B, Hi, rows, K) block indices of rows [i0, i1), -1 = empty. Duplicates count once (a set). offset:
    the position of query row 0 among the keys (S_k - S_q).
    """
    B, Hi, R, _ = idx_rows.shape
    i1 = offset + i1  # from here on, the key prefix the rows can see
    i0 = offset + i0
    nb = -(-i1 // block_size)
    idx = idx_rows.long()
    # Empty slots, and blocks past the chunk (causally invisible anyway), go to a spare column dropped below.
    slot = torch.where((idx >= 0) & (idx < nb), idx, torch.full_like(idx, nb))
    listed = torch.zeros(B, Hi, R, nb + 1, dtype=torch.bool, device=idx.device).scatter_(-1, slot, True)
    blk_of_t = torch.arange(0, i1, device=idx.device) // block_size
    return listed[..., blk_of_t] & causal_keys(i0, i1, idx.device)


def grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (B, Hq, R, X) @ b (B, Hb, X, Y) -> (B, Hq, R, Y); head h of a uses head h // (Hq / Hb) of b."""
    B, Hq, R, X = a.shape
    Hb = b.shape[1]
    return torch.matmul(a.reshape(B, Hb, Hq // Hb, R, X), b.unsqueeze(2)).reshape(B, Hq, R, b.shape[-1])


def grouped_sum_matmul(a: torch.Tensor, c: torch.Tensor, Hb: int) -> torch.Tensor:
    """sum over the heads h of each group and rows r of a[h, r, :]^T c[h, r, :]: (B, Hb, T, Y).

    a: (B, Hq, R, T), c: (B, Hq, R, Y); group g holds heads [g * Hq / Hb, (g + 1) * Hq / Hb). This is the dK / dV
    reduction over the query heads sharing one key head, done as one matmul over (head, row) pairs.
    """
    B, Hq, R, T = a.shape
    G = Hq // Hb
    return torch.matmul(a.reshape(B, Hb, G * R, T).transpose(-1, -2), c.reshape(B, Hb, G * R, c.shape[-1]))


def masked_scores(q_rows: torch.Tensor, k_pre: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * <q, k> of rows against the prefix, -inf where keys forbids: (B, Hq, R, T)."""
    B, Hq, R, _ = q_rows.shape
    T = k_pre.shape[2]
    s = grouped_matmul(q_rows, k_pre.transpose(-1, -2)) * scale
    Hi = keys.shape[1]
    s = s.view(B, Hi, Hq // Hi, R, T).masked_fill(~keys.unsqueeze(2), float("-inf"))
    return s.view(B, Hq, R, T)


def group_mean(p: torch.Tensor, Hp: int) -> torch.Tensor:
    """tau: mean of P over the G = H / Hp main heads of each proxy group, (B, Hp, R, T)."""
    B, H, R, T = p.shape
    return p.view(B, Hp, H // Hp, R, T).mean(dim=2)


def with_sink(lse0: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """lse of the softmax with each head's sink term: logaddexp(lse0, sink[h]); lse0 (B, H, R), sinks (H,)."""
    if sinks is None:
        return lse0
    return torch.logaddexp(lse0, sinks.to(lse0.dtype).view(1, -1, 1))


def sink_gradient(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d sink[h] = - sum over (b, i) of exp(sink[h] - lse) * delta (msa-semantics.md, "Attention sinks"); lse and
    delta (B, H, S). A sink of -inf has probability 0 everywhere (its rows' lse may be -inf too: no 0 * NaN)."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    p_sink = torch.where(sink == float("-inf"), torch.zeros((), dtype=lse.dtype, device=lse.device),
                         torch.exp(sink - lse))
    return -(p_sink * delta).sum(dim=(0, 2))


def forward(q, k, v, keys_of_rows: KeysOfRows, scale: float, q_proxy=None, k_proxy=None, *, proxy_scale=None,
            sinks=None):
    """Masked attention, and with the proxy tensors the KL of the proxy against the group-mean attention.

    proxy_scale: the proxy scores' scale (default scale). sinks (H,) or None: each head's sink logit joins its rows'
    softmax (lse includes it, out is scaled by 1 - p_sink) while the KL target tau stays the sink-free P (from
    lse0, the logsumexp over the allowed keys alone).

    q (B, H, S, D) and q_proxy hold the queries, k, v and k_proxy (B, heads, S_k, D) the keys, S_k >= S (query row
    i at position i + S_k - S). Returns out (B, H, S, D), lse (B, H, S) and, with a proxy, lse_proxy and kl_rows
    (B, Hp, S), all in the compute dtype. A row with no allowed key gets out = 0, lse = -inf (and lse_proxy = -inf,
    KL = 0). A NaN input reaches exactly the results that depend on it: a NaN score (in q, k, q_proxy or k_proxy)
    makes its row's lse, out and KL NaN, a NaN value (in v) the out elements of the rows that attend to it.
    """
    B, H, S, _ = q.shape
    off = k.shape[2] - S
    proxy_scale = scale if proxy_scale is None else proxy_scale
    out = torch.empty_like(q)
    lse = q.new_empty(B, H, S)
    with_proxy = q_proxy is not None
    if with_proxy:
        Hp = q_proxy.shape[1]
        lse_proxy = q.new_empty(B, Hp, S)
        kl_rows = q.new_empty(B, Hp, S)
    v, v_nan = without_nan(v)
    with _ieee_fp32_matmul():
        for i0, i1 in row_chunks(S, B * H * (off + S)):
            keys = keys_of_rows(i0, i1)
            t1 = off + i1  # the causal key prefix of rows [i0, i1)
            s = masked_scores(q[:, :, i0:i1], k[:, :, :t1], keys, scale)
            lse0_c = torch.logsumexp(s, dim=-1)
            lse_c = with_sink(lse0_c, sinks)
            p = probabilities(s, lse_c)
            out_c = grouped_matmul(p, v[:, :, :t1])
            if v_nan is not None:
                out_c = nan_where(out_c, grouped_matmul((s > float("-inf")).to(s.dtype), v_nan[:, :, :t1]))
            s_main = s if sinks is not None else None  # tau's sink-free P is formed from the scores again
            del s
            out[:, :, i0:i1] = out_c
            lse[:, :, i0:i1] = lse_c
            if with_proxy:
                tau = group_mean(p if sinks is None else probabilities(s_main, lse0_c), Hp)
                del p
                sp = masked_scores(q_proxy[:, :, i0:i1], k_proxy[:, :, :t1], keys, proxy_scale)
                lse_pc = torch.logsumexp(sp, dim=-1)
                log_pi = sp - empty_rows_zero(lse_pc).unsqueeze(-1)
                # KL terms with tau = 0 are 0 (they would be 0 * -inf where pi is masked too); a NaN tau (from a
                # NaN main score) or log_pi (a NaN proxy score) keeps its term, and so its row, NaN.
                terms = torch.where(tau == 0, torch.zeros((), dtype=tau.dtype, device=tau.device),
                                    tau * (torch.log(tau) - log_pi))
                lse_proxy[:, :, i0:i1] = lse_pc
                kl_rows[:, :, i0:i1] = terms.sum(dim=-1)
    if with_proxy:
        return out, lse, lse_proxy, kl_rows
    return out, lse


def backward(q, k, v, out, lse, keys_of_rows: KeysOfRows, scale: float, grad_out,
             q_proxy=None, k_proxy=None, lse_proxy=None, kl_weights=None, *, proxy_scale=None, sinks=None):
    """Gradients from the explicit formulas (P recomputed from the saved lse; no autograd).

    main, when grad_out is given: delta = rowsum(dO * O); dP = dO V^T; dS = P (dP - delta);
      dq = scale dS K; dk = scale dS^T Q and dv = P^T dO, both summed over the heads sharing a kv head.
    proxy, when kl_weights (B, Hp, S) is given: pi = exp(s_p - lse_proxy) on the allowed keys; tau = group mean of
      P; dS_p = (pi - tau) * kl_weights; dq_proxy = scale dS_p K_p; dk_proxy = scale dS_p^T Q_p (summed likewise).
    Shapes as forward() (keys may outnumber queries). Returns (dq, dk, dv, dq_proxy, dk_proxy) in the compute dtype;
    a part without upstream gradient is zeros.
    proxy_scale: the proxy scores' scale (default scale; it also scales dq_proxy and dk_proxy). sinks (H,) or None:
      lse then includes the sink (forward's lse), so P above is the sink-adjusted one and out the sink-adjusted
      output: dq, dk, dv are exact as written; tau is the sink-free P, from lse0 recomputed from the scores. With
      sinks a sixth result: d sinks (H,) in the compute dtype (sink_gradient; zeros without grad_out).
    dS and dS_p are exactly 0 on the keys a row cannot see, and the matmuls that sum over rows or keys run on
    NaN-free operands, so a NaN reaches the gradients of the rows and keys that depend on it and no others.
    """
    B, H, S, _ = q.shape
    Hk = k.shape[1]
    off = k.shape[2] - S
    proxy_scale = scale if proxy_scale is None else proxy_scale
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    main = grad_out is not None
    with_proxy = q_proxy is not None and kl_weights is not None
    dq_proxy = torch.zeros_like(q_proxy) if q_proxy is not None else None
    dk_proxy = torch.zeros_like(k_proxy) if k_proxy is not None else None
    d_sinks = None if sinks is None else torch.zeros(H, dtype=q.dtype, device=q.device)
    if not (main or with_proxy):
        return (dq, dk, dv, dq_proxy, dk_proxy) + (() if sinks is None else (d_sinks,))
    if main:
        delta = (grad_out * out).sum(dim=-1)  # (B, H, S)
        if sinks is not None:
            d_sinks = sink_gradient(lse, delta, sinks)
        grad_out, do_nan = without_nan(grad_out)
    # A NaN in q (k) already makes dS NaN on every key (row) that depends on it; the cleaned copies only keep
    # masked zeros from turning into NaN in dk = dS^T q and dq = dS k.
    q, _ = without_nan(q)
    k, _ = without_nan(k)
    if with_proxy:
        q_proxy, _ = without_nan(q_proxy)
        k_proxy, _ = without_nan(k_proxy)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    dv_hits = torch.zeros_like(v) if main and do_nan is not None else None
    with _ieee_fp32_matmul():
        for i0, i1 in row_chunks(S, B * H * (off + S)):
            keys = keys_of_rows(i0, i1)
            t1 = off + i1  # the causal key prefix of rows [i0, i1)
            q_rows, k_pre, v_pre = q[:, :, i0:i1], k[:, :, :t1], v[:, :, :t1]
            s = masked_scores(q_rows, k_pre, keys, scale)
            p = probabilities(s, lse[:, :, i0:i1])
            allowed = s > float("-inf")
            if sinks is None or not with_proxy:
                del s
            if main:
                do = grad_out[:, :, i0:i1]
                dp = grouped_matmul(do, v_pre.transpose(-1, -2))
                ds = torch.where(allowed, p * (dp - delta[:, :, i0:i1].unsqueeze(-1)), zero)
                del dp
                dq[:, :, i0:i1] = scale * grouped_matmul(ds, k_pre)
                dk[:, :, :t1] += scale * grouped_sum_matmul(ds, q_rows, Hk)
                dv[:, :, :t1] += grouped_sum_matmul(p, do, Hk)
                if do_nan is not None:
                    dv_hits[:, :, :t1] += grouped_sum_matmul(allowed.to(p.dtype), do_nan[:, :, i0:i1], Hk)
                del ds
            if with_proxy:
                Hp, Hpk = q_proxy.shape[1], k_proxy.shape[1]
                tau = group_mean(p if sinks is None else probabilities(s, torch.logsumexp(s, dim=-1)), Hp)
                del p
                qp_rows, kp_pre = q_proxy[:, :, i0:i1], k_proxy[:, :, :t1]
                sp = masked_scores(qp_rows, kp_pre, keys, proxy_scale)
                pi = probabilities(sp, lse_proxy[:, :, i0:i1])
                dsp = torch.where(sp > float("-inf"), (pi - tau) * kl_weights[:, :, i0:i1].unsqueeze(-1), zero)
                dq_proxy[:, :, i0:i1] = proxy_scale * grouped_matmul(dsp, kp_pre)
                dk_proxy[:, :, :t1] += proxy_scale * grouped_sum_matmul(dsp, qp_rows, Hpk)
    if main:
        dv = nan_where(dv, dv_hits)
    return (dq, dk, dv, dq_proxy, dk_proxy) + (() if sinks is None else (d_sinks,))


def proxied_backward(fn, q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, grad_out, kl_grad, scale, dt,
                     keys_of_rows, proxy_scale=None, sinks=None):
    """MSA and warmup backward on (B, S, heads, D) tensors: check the saved ones, run backward(), cast back.

    -> (dq_proxy, dk_proxy, dq, dk, dv) in their inputs' dtypes, and with sinks a sixth, d sinks (H,) float32.
    """
    B, S, H, D = q.shape
    Hp = q_proxy.shape[2]
    checks.like(fn, "out", out, (B, S, H, D))
    checks.like(fn, "lse", lse, (B, H, S))
    checks.like(fn, "lse_proxy", lse_proxy, (B, Hp, S))
    if grad_out is not None:
        checks.like(fn, "grad_out", grad_out, (B, S, H, D))
    weights = checks.kl_weights(fn, kl_grad, (B, Hp, S), dt, q.device)
    hf = [heads_first(x, dt) for x in (q_proxy, k_proxy, q, k, v, out)]
    do = heads_first(grad_out, dt) if grad_out is not None else None
    dq, dk, dv, dqp, dkp, *d_sinks = backward(
        *hf[2:], lse.to(dt), keys_of_rows, scale, do, q_proxy=hf[0], k_proxy=hf[1], lse_proxy=lse_proxy.to(dt),
        kl_weights=weights, proxy_scale=proxy_scale, sinks=checks.sinks(fn, sinks, H, q.device))
    grads = (seq_first(dqp, q_proxy.dtype), seq_first(dkp, k_proxy.dtype),
             seq_first(dq, q.dtype), seq_first(dk, k.dtype), seq_first(dv, v.dtype))
    return grads + tuple(g.float() for g in d_sinks)
