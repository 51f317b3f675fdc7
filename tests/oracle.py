"""Brute-force dense oracles of every MSA op (docs/msa-semantics.md), with autograd for the gradients.

Full S x S score matrices in the dtype of the inputs (float64 for the verdict), built independently of the
reference: selection by a Python stable sort of (-score, block index) per row, masks by comparing every key's
block with every listed slot, gradients by torch.autograd.grad. Small shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass
class Result:
    out: torch.Tensor | None = None  # (B, S, H, D)
    lse: torch.Tensor | None = None  # (B, H, S)
    lse_proxy: torch.Tensor | None = None  # (B, Hp, S)
    kl_rows: torch.Tensor | None = None  # (B, Hp, S)
    kl_loss: torch.Tensor | None = None  # 0-dim: mean of kl_rows
    block_indices: torch.Tensor | None = None  # (B, Hp, S, K) int64, ascending, -1 last
    grads: dict | None = None  # name of each input -> gradient


def select(q_proxy, k_proxy, top_k_blocks, block_size, scale, local_blocks=1):
    """(B, Hp, S, K) int64: the L = local_blocks forced blocks ending at the local one, then the K - L best
    earlier blocks by a stable sort of (-score, j)."""
    B, S, Hp, _ = q_proxy.shape
    Bs, K = block_size, top_k_blocks
    NB = -(-S // Bs)
    s = _scores(q_proxy, k_proxy, scale).masked_fill(~_causal(S, q_proxy.device), NEG_INF)  # (B, Hp, S, S)
    s = F.pad(s, (0, NB * Bs - S), value=NEG_INF)  # whole blocks; padded keys are never visible
    c = s.view(B, Hp, S, NB, Bs).amax(-1).tolist()
    out = torch.full((B, Hp, S, K), -1, dtype=torch.long)
    for b in range(B):
        for p in range(Hp):
            for i in range(S):
                first = max(0, i // Bs - local_blocks + 1)
                best = sorted(range(first), key=lambda j: (-c[b][p][i][j], j))[:K - local_blocks]
                chosen = sorted([*range(first, i // Bs + 1), *best])
                out[b, p, i, :len(chosen)] = torch.tensor(chosen)
    return out.to(q_proxy.device)


def allowed_from_indices(block_indices, S, block_size):
    """(B, Hi, S, S) bool: t allowed to i iff t <= i and blk(t) equals one of row i's slots."""
    blk_of_t = torch.arange(S, device=block_indices.device) // block_size
    listed = (block_indices.long().unsqueeze(-1) == blk_of_t).any(dim=-2)  # (B, Hi, S, S)
    return listed & _causal(S, block_indices.device)


def attention(q, k, v, allowed, scale, sinks=None):
    """Masked softmax attention -> out (B, S, H, D), lse (B, H, S), P0 (B, H, S, S). allowed: (B|1, Hi, S, S).

    sinks (H,) or None: one extra logit per head with no value joins each row's softmax (a column appended to the
    scores, so autograd gives d sinks); lse and out include it, the returned P0 is the sink-free softmax (the KL
    target's)."""
    H = q.shape[2]
    Hk, Hi = k.shape[2], allowed.shape[1]
    kk = k.repeat_interleave(H // Hk, dim=2)
    vv = v.repeat_interleave(H // Hk, dim=2)
    mask = allowed.repeat_interleave(H // Hi, dim=1)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    p0, lse0 = _masked_softmax(s, mask)
    if sinks is None:
        return torch.einsum("bhij,bjhd->bihd", p0, vv), lse0, p0
    B, H, S, _ = s.shape
    sink_col = sinks.to(s.dtype).view(1, H, 1, 1).expand(B, H, S, 1)
    full = torch.cat([s.masked_fill(~mask, NEG_INF), sink_col], dim=-1)
    lse = torch.logsumexp(full, -1)
    p = torch.where(torch.cat([mask.expand(B, H, S, S), torch.ones_like(sink_col, dtype=torch.bool)], -1),
                    torch.exp(full - lse.unsqueeze(-1)), 0)[..., :S]
    return torch.einsum("bhij,bjhd->bihd", p, vv), lse, p0


def proxy_kl(q_proxy, k_proxy, p_main, allowed, scale):
    """KL_p(i) of pi (proxy softmax over the allowed set) from the detached group mean tau -> (kl_rows, lse_p)."""
    B, S, Hp, _ = q_proxy.shape
    H = p_main.shape[1]
    mask = allowed.repeat_interleave(Hp // allowed.shape[1], dim=1)
    s = _scores(q_proxy, k_proxy, scale)
    _, lse_p = _masked_softmax(s, mask)
    log_pi = torch.where(mask, s - torch.where(torch.isfinite(lse_p), lse_p, 0).unsqueeze(-1), NEG_INF)
    tau = p_main.detach().view(B, Hp, H // Hp, S, S).mean(2)
    # F.kl_div(log_pi, tau, 'none') = tau (log tau - log_pi), 0 where tau = 0; masked keys (log_pi = -inf) -> 0.
    terms = F.kl_div(torch.where(mask, log_pi, 0), tau, reduction="none")
    kl_rows = torch.where(tau > 0, terms, 0).sum(-1)
    return kl_rows, lse_p


def msa(q_proxy, k_proxy, q, k, v, top_k_blocks, block_size, scale, grad_out=None, kl_upstream=None,
        block_indices=None, *, proxy_scale=None, local_blocks=1, sinks=None):
    """Everything MSA computes, and the five gradients.

    block_indices None: selected here (the proxy's top-K). grad_out: upstream dO of out or None. kl_upstream:
    a 0-dim tensor (upstream grad of kl_loss = mean KL) or a (B, Hp, S) tensor (upstream grad of each KL_p(i)),
    or None. proxy_scale (None: scale) scales the proxy scores; local_blocks forces that many recent blocks;
    sinks (H,) adds a sink logit per head (grads["sinks"] then holds d sinks).
    """
    S = q.shape[1]
    proxy_scale = scale if proxy_scale is None else proxy_scale
    if block_indices is None:
        with torch.no_grad():
            block_indices = select(q_proxy, k_proxy, top_k_blocks, block_size, proxy_scale, local_blocks)
    return _with_grads(q_proxy, k_proxy, q, k, v, allowed_from_indices(block_indices, S, block_size), scale,
                       grad_out, kl_upstream, block_indices, proxy_scale, sinks)


def warmup(q_proxy, k_proxy, q, k, v, scale, grad_out=None, kl_upstream=None, *, proxy_scale=None, sinks=None):
    allowed = _causal(q.shape[1], q.device).view(1, 1, q.shape[1], q.shape[1])
    return _with_grads(q_proxy, k_proxy, q, k, v, allowed, scale, grad_out, kl_upstream, None,
                       scale if proxy_scale is None else proxy_scale, sinks)


def block_sparse(q, k, v, block_indices, block_size, scale, grad_out=None, *, sinks=None):
    return _with_grads(None, None, q, k, v, allowed_from_indices(block_indices, q.shape[1], block_size), scale,
                       grad_out, None, block_indices, None, sinks)


def rows(q_proxy, k_proxy, q, k, v, query_rows, scale, block_indices=None, block_size=128):
    """Result(out (B, R, H, D), lse (B, H, R), lse_proxy, kl_rows (B, Hp, R)) of the given query rows only, in the
    inputs' dtype: what the whole-sequence oracle would give there, for sequences too long for S x S matrices.

    Each row's allowed keys are t <= i in the listed blocks of block_indices (B, Hp, S, K), or every t <= i when
    block_indices is None (warmup: dense causal). The main heads of proxy head p read row (b, p, i)'s list.
    """
    B, S, H, _ = q.shape
    Hk, Hp, Hpk = k.shape[2], q_proxy.shape[2], k_proxy.shape[2]
    G = H // Hp
    out = q.new_zeros(B, len(query_rows), H, q.shape[-1])
    lse = q.new_zeros(B, H, len(query_rows))
    lse_p, kl = q.new_zeros(B, Hp, len(query_rows)), q.new_zeros(B, Hp, len(query_rows))
    blk_of_t = torch.arange(S, device=q.device) // block_size
    for r, i in enumerate(query_rows):
        t = torch.arange(i + 1, device=q.device)
        for b in range(B):
            for p in range(Hp):
                keys = t if block_indices is None else \
                    t[(blk_of_t[:i + 1].unsqueeze(-1) == block_indices[b, p, i].long()).any(-1)]
                heads = torch.arange(p * G, (p + 1) * G, device=q.device)
                kk, vv = k[b, keys][:, heads // (H // Hk)], v[b, keys][:, heads // (H // Hk)]  # (T, G, D)
                s = torch.einsum("gd,tgd->gt", q[b, i, heads], kk) * scale
                row_lse = torch.logsumexp(s, -1)
                prob = torch.exp(s - row_lse.unsqueeze(-1))
                out[b, r, heads] = torch.einsum("gt,tgd->gd", prob, vv)
                lse[b, heads, r] = row_lse
                s_p = k_proxy[b, keys, p // (Hp // Hpk)] @ q_proxy[b, i, p] * scale
                lse_p[b, p, r] = torch.logsumexp(s_p, -1)
                tau = prob.mean(0)
                log_pi = s_p - lse_p[b, p, r]
                kl[b, p, r] = torch.where(tau > 0, tau * (torch.log(torch.where(tau > 0, tau, 1)) - log_pi), 0).sum()
    return Result(out=out, lse=lse, lse_proxy=lse_p, kl_rows=kl)


def _with_grads(q_proxy, k_proxy, q, k, v, allowed, scale, grad_out, kl_upstream, block_indices, proxy_scale=None,
                sinks=None):
    named = {"q": q, "k": k, "v": v}
    if q_proxy is not None:
        named = {"q_proxy": q_proxy, "k_proxy": k_proxy, **named}
    if sinks is not None:
        named["sinks"] = sinks.to(q.dtype)
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in named.items()}
    with torch.enable_grad():
        out, lse, p = attention(leaves["q"], leaves["k"], leaves["v"], allowed, scale, leaves.get("sinks"))
        res = Result(out=out, lse=lse, block_indices=block_indices)
        loss = out.new_zeros(())
        if grad_out is not None:
            loss = loss + (out * grad_out).sum()
        if q_proxy is not None:
            res.kl_rows, res.lse_proxy = proxy_kl(leaves["q_proxy"], leaves["k_proxy"], p, allowed,
                                                  scale if proxy_scale is None else proxy_scale)
            res.kl_loss = res.kl_rows.mean()
            if kl_upstream is not None:
                if kl_upstream.dim() == 0:
                    loss = loss + res.kl_loss * kl_upstream
                else:
                    loss = loss + (res.kl_rows * kl_upstream).sum()
        if loss.requires_grad:
            gs = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        else:
            gs = [None] * len(leaves)
    res.grads = {n: (g if g is not None else torch.zeros_like(t)) for (n, t), g in zip(leaves.items(), gs)}
    for f in ("out", "lse", "lse_proxy", "kl_rows", "kl_loss"):
        if getattr(res, f) is not None:
            setattr(res, f, getattr(res, f).detach())
    return res


def _scores(q, k, scale):
    """(B, Hq, S, S) scores; query head h reads key head h // (Hq / Hk)."""
    kk = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bihd,bjhd->bhij", q, kk) * scale


def _causal(S, device):
    return torch.ones(S, S, dtype=torch.bool, device=device).tril()


def _masked_softmax(s, mask):
    """softmax over the allowed keys -> (P, lse); a row with none: P = 0, lse = -inf, and finite gradients."""
    has = mask.any(-1, keepdim=True)
    s = torch.where(has, s.masked_fill(~mask, NEG_INF), 0)  # empty rows get a harmless finite row
    lse = torch.logsumexp(s, -1)
    p = torch.where(mask, torch.exp(s - lse.unsqueeze(-1)), 0)
    return p, torch.where(has.squeeze(-1), lse, NEG_INF)


# --- comparison ---------------------------------------------------------------------------------------------

def assert_close(name, got, want, base_err, *, factor=3.0, atol=0.0):
    """|got - want| <= factor * base_err + atol, after requiring the same inf / NaN positions (and signs).

    want: the float64 oracle. base_err: what the input dtype costs for this quantity (see tolerance()): the
    reference may cost a small multiple of it (FlashAttention's rule).
    """
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: NaN positions differ"
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{name}: inf positions differ"
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf]), f"{name}: infinities of different sign"
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    bound = factor * base_err + atol
    assert err <= bound, f"{name}: max error {err:.3e} > {factor} * {base_err:.3e} + {atol:.1e} = {bound:.3e}"
    return err, bound

def dtype_error(want, *baselines):
    """max |baseline - want| over positions where both are finite: what computing in a lower precision costs."""
    worst = 0.0
    for b in baselines:
        b, w = b.double(), want.double()
        fin = torch.isfinite(b) & torch.isfinite(w)
        if fin.any():
            worst = max(worst, (b[fin] - w[fin]).abs().max().item())
    return worst


# --- test harness -------------------------------------------------------------------------------------------

def randn(gen, shape, dtype):
    """Fresh standard-normal values (drawn in float64), rounded to dtype."""
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def tolerance(want, got_dtype, baseline32=None, *, rounds_to_dtype=True):
    """(error the input dtype costs, atol) for comparing a reference result with the float64 oracle `want`.

    float64 inputs: nothing but float64 rounding, so a tight atol relative to the magnitude. Otherwise the error
    of the float32 oracle (baseline32) and, for results returned in a 16-bit dtype, the rounding of the exact
    result to that dtype.
    """
    mag = want.double()[torch.isfinite(want)].abs().max().item() if torch.isfinite(want).any() else 0.0
    if got_dtype == torch.float64:
        return 0.0, 1e-10 * max(1.0, mag)
    errs = [baseline32] if baseline32 is not None else []
    if rounds_to_dtype and got_dtype in (torch.bfloat16, torch.float16):
        errs.append(want.to(got_dtype))
    return dtype_error(want, *errs), 1e-6 * max(1.0, mag)


def check(name, got, want, got_dtype, baseline32=None, *, rounds_to_dtype=True, factor=3.0):
    base, atol = tolerance(want, got_dtype, baseline32, rounds_to_dtype=rounds_to_dtype)
    return assert_close(name, got, want, base, factor=factor, atol=atol)
