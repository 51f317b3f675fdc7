"""A pure-torch emulation (test code) of the KV-outer sparse kernels' contracts (forward, KL pass, proxy backward),
item by item.

This is the executable spec of the kernel's contract with flash_msa_rt.ops.sparse_plan, not a fast path: it loops
over the plan's items in Python and SYNCHRONISES the host with the device (it reads the items with .tolist()).
Use it to test the plan and the combines on any device, and as the oracle a kernel's partial buffers are checked
against (compare only the rows of live entries: the others are never written).

Per item (bp, j, entry_start, n_entries) with n_entries > 0, as the kernel does: b, p = divmod(bp, Hp); key block j
holds tokens [j * Bs, min((j + 1) * Bs, Sk)); the item's entries are cut into tiles of tile_queries queries, each a
(tq * G)-row tile whose row r is (query r // G, head p * G + r % G); per row, the causal keys t <= i of block j.

Forward pass, at row entry_dest[e]: o_part[e, g] = sum_t exp(s - lse_slot) v_t (normalised by the block's own sum)
and lse_part[e, g] = lse_slot = logsumexp of s = scale <q[b, i, h], k[b, t, h // (H / Hk)]>.
KL pass, from the final lse (B, H, S): per key group, the (A, T, L) triple of emulate_kl, with the proxy scores
s_p = scale <q_proxy[b, i, p], k_proxy[b, t, p // (Hp / Hpk)]>; combine_kl_lse makes lse_proxy and the KL.

Math in float32 (float64 when any input is float64); o_part is stored in q.dtype, statistics in the math dtype.
Inputs in the internal layout: q (B, S, H, D), k, v (B, Sk, Hk, D), q_proxy (B, S, Hp, Dp), k_proxy (B, Sk, Hpk, Dp):
keys may outnumber queries (Sk >= S), query row i then sits at key position Sk - S + i and the causal keys of
block j are t <= Sk - S + i (the plan's key_offset is Sk - S).
"""

from __future__ import annotations

import math

import torch

from flash_msa_rt.ops.partials import empty_forward_partials, kl_groups, partial_shapes
from flash_msa_rt.ops.sparse_plan import SparsePlan
from flash_msa_rt.reference.numerics import _ieee_fp32_matmul, compute_dtype, finite_or_zero


def _tiles(plan: SparsePlan):
    """(b, p, j, entries of one tile) for every tile of every real item, in the kernel's order."""
    tq = plan.tile_queries
    for bp, j, start, n in plan.items.tolist():
        if n == 0:
            continue
        assert 0 < n <= plan.entries_per_item, (bp, j, start, n)
        b, p = divmod(bp, plan.Hp)
        for t0 in range(start, start + n, tq):
            yield b, p, j, torch.arange(t0, min(start + n, t0 + tq), device=plan.entry_query.device)


def _tile_scores(plan, q, k, q_proxy, k_proxy, b, p, j, e, scale, dt):
    """Main scores (rows, G, keys) and proxy scores (rows, keys) of one tile, -inf on non-causal keys."""
    G, Bs = plan.group, plan.block_size
    H, Hk, Hp, Hpk = q.shape[2], k.shape[2], q_proxy.shape[2], k_proxy.shape[2]
    i = plan.entry_query[e].long()
    t0, t1 = j * Bs, min((j + 1) * Bs, k.shape[1])  # plan.S is a chunk's length when planned in chunks
    # keys longer than queries (the kernels' Sk - S from the shapes): query row i sits at key position off + i
    off = k.shape[1] - q.shape[1]
    heads = torch.arange(p * G, (p + 1) * G, device=q.device)
    qt = q[b, i][:, heads].to(dt)  # (rows, G, D): a (query, G heads) row group is contiguous in BSHD
    kt = k[b, t0:t1][:, heads // (H // Hk)].to(dt)  # (keys, G, D)
    causal = torch.arange(t0, t1, device=q.device).view(1, -1) <= (off + i).view(-1, 1)  # (rows, keys)
    ninf = float("-inf")
    s = (torch.einsum("rgd,tgd->rgt", qt, kt) * scale).masked_fill(~causal.unsqueeze(1), ninf)
    qp = q_proxy[b, i, p].to(dt)
    kp = k_proxy[b, t0:t1, p // (Hp // Hpk)].to(dt)
    sp = (qp @ kp.T * scale).masked_fill(~causal, ninf)
    return s, sp, i, t0, t1


def emulate_forward(plan: SparsePlan, q, k, v, q_proxy, k_proxy, scale: float):
    """-> (o_part (E, G, D) q.dtype, lse_part (E, G)): the forward pass; dead rows stay garbage."""
    dt = compute_dtype(q, k, v, q_proxy, k_proxy)
    Hk = k.shape[2]
    H = q.shape[2]
    o_part, lse_part = empty_forward_partials(plan, q.shape[-1], q.dtype, q.device, stat_dtype=dt)
    with _ieee_fp32_matmul():
        for b, p, j, e in _tiles(plan):
            s, _, _, t0, t1 = _tile_scores(plan, q, k, q_proxy, k_proxy, b, p, j, e, scale, dt)
            heads = torch.arange(p * plan.group, (p + 1) * plan.group, device=q.device)
            vt = v[b, t0:t1][:, heads // (H // Hk)].to(dt)  # (keys, G, D)
            lse = torch.logsumexp(s, dim=-1)  # (rows, G)
            prob = torch.exp(s - finite_or_zero(lse).unsqueeze(-1))
            dest = plan.entry_dest[e].long()
            o_part[dest] = torch.einsum("rgt,tgd->rgd", prob, vt).to(q.dtype)
            lse_part[dest] = lse
    return o_part, lse_part


def emulate_kl(plan: SparsePlan, q, k, q_proxy, k_proxy, lse, scale: float):
    """-> kl_part (E, 3 * kl_groups(Bs)): the KL pass on the final lse (B, H, S); dead rows garbage.

    Per entry and key group of 32 keys (the kernel's 64-key slices x 2 key warps; any split gives the same
    combine), in log2 units over the group's causal keys: A = sum tau (log2 tau - s_p log2 e), T = sum tau,
    L = log2 sum 2^(s_p log2 e) (-inf without a causal key); tau = mean over the G heads of exp(s_h - lse_h).
    """
    dt = compute_dtype(q, k, q_proxy, k_proxy)
    G = plan.group
    log2e = 1.0 / math.log(2.0)
    n_groups = kl_groups(plan.block_size)
    kl_part = torch.empty(partial_shapes(plan, q.shape[-1])["kl_part"], dtype=dt, device=q.device)
    zero = torch.zeros((), dtype=dt, device=q.device)
    with _ieee_fp32_matmul():
        for b, p, j, e in _tiles(plan):
            s, sp, i, t0, t1 = _tile_scores(plan, q, k, q_proxy, k_proxy, b, p, j, e, scale, dt)
            lse_rows = lse[b, p * G:(p + 1) * G][:, i].T.to(dt)  # (rows, G)
            tau = torch.exp(s - finite_or_zero(lse_rows).unsqueeze(-1)).mean(dim=1)  # (rows, keys)
            sp2 = sp * log2e  # -inf on non-causal keys
            parts = torch.empty((len(e), n_groups, 3), dtype=dt, device=q.device)
            for grp in range(n_groups):
                cols = slice(grp * 32, min((grp + 1) * 32, t1 - t0))
                ta, s2 = tau[:, cols], sp2[:, cols]
                live = ta > 0
                parts[:, grp, 0] = torch.where(live, ta * (torch.log2(torch.where(live, ta, 1)) - s2), zero).sum(-1)
                parts[:, grp, 1] = ta.sum(-1)
                parts[:, grp, 2] = torch.logsumexp(s2 * math.log(2.0), dim=-1) * log2e if s2.shape[1] else \
                    torch.full((len(e),), float("-inf"), dtype=dt, device=q.device)
            kl_part[plan.entry_dest[e].long()] = parts.view(len(e), -1)
    return kl_part


def emulate_proxy_backward(plan: SparsePlan, q, k, q_proxy, k_proxy, lse, lse_proxy, kl_grad, scale: float,
                           dqp_acc, dkp_acc):
    """The proxy backward kernel's contract (kernels_src.sparse_bwd_proxy), added into the fp32 accumulators as
    the kernel's reductions do: per tile, dS_p = (pi - tau) * kl_grad[b, p, i] with pi = exp(s_p - lse_p) and tau
    the mean over the G heads of exp(s_h - lse_h), then dq_p[b, i, p] += scale dS_p K_p and
    dk_p[b, t, p // (Hp / Hpk)] += scale dS_p^T Q_p. lse (B, H, S), lse_proxy and kl_grad (B, Hp, S)."""
    dt = compute_dtype(q, k, q_proxy, k_proxy)
    G, Hp, Hpk = plan.group, q_proxy.shape[2], k_proxy.shape[2]
    with _ieee_fp32_matmul():
        for b, p, j, e in _tiles(plan):
            s, sp, i, t0, t1 = _tile_scores(plan, q, k, q_proxy, k_proxy, b, p, j, e, scale, dt)
            lse_rows = lse[b, p * G:(p + 1) * G][:, i].T.to(dt)  # (rows, G)
            tau = torch.exp(s - finite_or_zero(lse_rows).unsqueeze(-1)).mean(dim=1)  # (rows, keys)
            pi = torch.exp(sp - finite_or_zero(lse_proxy[b, p, i].to(dt)).unsqueeze(-1))
            ds = (pi - tau) * kl_grad[b, p, i].to(dt).unsqueeze(-1)
            pkh = p // (Hp // Hpk)
            dqp_acc[b, i, p] += (scale * ds @ k_proxy[b, t0:t1, pkh].to(dt)).to(dqp_acc.dtype)
            dkp_acc[b, t0:t1, pkh] += (scale * ds.T @ q_proxy[b, i, p].to(dt)).to(dkp_acc.dtype)


# --- the plan_lists kernels (kernels_src/plan_lists) ---------------------------------------------------------------

def plan_lists_kernels(block_size: int, tile_rows: int = 128):
    """(count, scatter, items): the plan kernels' contracts in Python, tile by tile and list by list, for
    sparse_plan._kernel_plans' kernels argument (CPU tests of the host glue and the key layout)."""
    import numpy as np

    Bs = block_size

    def tiles_of(block_indices, heads, queries):
        B, Hp, S, K = block_indices.shape
        idx = block_indices.cpu().numpy()
        n_q = -(-S // queries)
        nbq = queries // Bs
        bc = B * heads
        per_group = bc * (nbq * (n_q - 1) * n_q // 2 + -(-S // Bs) + n_q)
        for b in range(B):
            for p in range(Hp):
                for t in range(-(-S // tile_rows)):
                    hg, pc, r0 = p // heads, p % heads, t * tile_rows
                    qc = r0 // queries
                    q_lo, q_hi = qc * queries, min(S, qc * queries + queries)
                    nb = -(-q_hi // Bs)
                    kbase = hg * per_group + bc * (nbq * qc * (qc + 1) // 2 + qc)
                    r = np.arange(r0, min(S, r0 + tile_rows))
                    rows = idx[b, p, r0:r0 + len(r)]
                    live = (rows >= 0) & (rows <= (r // Bs)[:, None])
                    yield dict(b=b, pc=pc, r=r, rows=rows, live=live, q_lo=q_lo, length=q_hi - q_lo, nb=nb,
                               kbase=kbase, first=kbase + (b * heads + pc) * nb, dead=kbase + bc * nb + b * heads + pc,
                               column=t - q_lo // tile_rows, chunk=hg * n_q + qc, bc=bc, K=K)

    def count(block_indices, counts, heads, queries, tiles):
        out = counts.cpu().numpy().copy()
        for tk in tiles_of(block_indices, heads, queries):
            per_block = np.bincount(tk["rows"][tk["live"]], minlength=tk["nb"])
            for j in np.nonzero(per_block)[0]:
                out[(tk["first"] + j) * tiles + tk["column"]] = per_block[j]
            dead = int((~tk["live"]).sum())
            if dead:
                out[tk["dead"] * tiles + tk["column"]] = dead
        counts.copy_(torch.from_numpy(out))

    def scatter(block_indices, counts, ends, entry_query, entry_dest, lists, heads, queries, tiles):
        c, e = counts.cpu().numpy(), ends.cpu().numpy()
        eq, ed, ls = entry_query.cpu().numpy().copy(), entry_dest.cpu().numpy().copy(), lists.cpu().numpy().copy()
        for tk in tiles_of(block_indices, heads, queries):
            rr, kk = np.nonzero(np.ones_like(tk["live"]))  # (row, slot) order
            r, j, live = tk["r"][rr], tk["rows"][rr, kk], tk["live"][rr, kk]
            dest = ((tk["b"] * heads + tk["pc"]) * tk["length"] + r - tk["q_lo"]) * tk["K"] + kk
            dci = tk["dead"] * tiles + tk["column"]
            pos = e[dci] - c[dci] + np.arange(int((~live).sum()))
            eq[pos], ed[pos] = r[~live], dest[~live]
            for jb in np.unique(j[live]):
                sel = live & (j == jb)  # one entry per row: ranked by row
                ci = (tk["first"] + jb) * tiles + tk["column"]
                pos = e[ci] - c[ci] + np.arange(int(sel.sum()))
                eq[pos], ed[pos] = r[sel], dest[sel]
            if tk["column"] == 0:
                start0 = e[tk["kbase"] * tiles] - c[tk["kbase"] * tiles]
                before = (tk["b"] * heads + tk["pc"]) * tk["nb"]
                for jb in range(tk["nb"]):
                    ci = (tk["first"] + jb) * tiles
                    ls[tk["chunk"], 0, before + jb] = e[ci] - c[ci] - start0
                    ls[tk["chunk"], 1, before + jb] = e[ci + tiles - 1] - (e[ci] - c[ci])
                if tk["b"] == 0 and tk["pc"] == 0:
                    di = (tk["kbase"] + tk["bc"] * tk["nb"]) * tiles
                    ls[tk["chunk"], 0, tk["bc"] * tk["nb"]] = e[di] - c[di] - start0
        for t, a in ((entry_query, eq), (entry_dest, ed), (lists, ls)):
            t.copy_(torch.from_numpy(a))

    def items(lists, items, item_count, seqlen, queries, lists_per_block, entries0, entries1):
        ls, out, counts = lists.cpu().numpy(), np.zeros(tuple(items.shape), np.int32), np.zeros(
            tuple(item_count.shape), np.int32)
        n_q = -(-seqlen // queries)
        for m in range(items.shape[0]):
            size = entries0 if m == 0 else entries1
            for n in range(lists.shape[0]):
                nb = -(-min(seqlen, (n % n_q + 1) * queries) // Bs)
                w = 0
                for lst in range(lists_per_block * nb):
                    start, count = int(ls[n, 0, lst]), int(ls[n, 1, lst])
                    for first in range(0, count, size):
                        out[m, n, w] = (lst // nb, lst % nb, start + first, min(size, count - first))
                        w += 1
                counts[m, n] = w
        items.copy_(torch.from_numpy(out))
        item_count.copy_(torch.from_numpy(counts))

    return count, scatter, items


def emulate_main_backward(plan: SparsePlan, q, k, v, dout, lse, delta, scale: float, dq_acc, dk_acc, dv_acc):
    """The main backward kernel's contract (kernels_src.sparse_bwd, atomic path), added into the fp32 accumulators
    as its reductions do: per tile and head h = p * G + g, P = exp(s_h - lse_h) over the causal keys of block j,
    dS = P (dO V^T - delta), then dq[b, i, h] += scale dS K, dk[b, t, h // (H / Hk)] += scale dS^T Q and
    dv[b, t, h // (H / Hk)] += P^T dO. lse and delta (B, H, S)."""
    dt = compute_dtype(q, k, v)
    G, H, Hk = plan.group, q.shape[2], k.shape[2]
    with _ieee_fp32_matmul():
        for b, p, j, e in _tiles(plan):
            s, _, i, t0, t1 = _tile_scores(plan, q, k, q[:, :, :H // G], k[:, :, :1], b, p, j, e, scale, dt)
            for g in range(G):
                h = p * G + g
                kvh = h // (H // Hk)
                prob = torch.exp(s[:, g] - finite_or_zero(lse[b, h, i].to(dt)).unsqueeze(-1))  # (rows, keys)
                do, kt, vt = dout[b, i, h].to(dt), k[b, t0:t1, kvh].to(dt), v[b, t0:t1, kvh].to(dt)
                ds = prob * (do @ vt.T - delta[b, h, i].to(dt).unsqueeze(-1))
                dq_acc[b, i, h] += (scale * ds @ kt).to(dq_acc.dtype)
                dk_acc[b, t0:t1, kvh] += (scale * ds.T @ q[b, i, h].to(dt)).to(dk_acc.dtype)
                dv_acc[b, t0:t1, kvh] += (prob.T @ do).to(dv_acc.dtype)


def emulate_proxy_backward_launches(monkeypatch, sparse_bwd) -> list:
    """Replace sparse_bwd's plan builder and kernel loader so that proxy_backward_cuda runs the emulated proxy
    backward on every plan it builds; returns the list the plans are recorded in, in build order."""
    from flash_msa_rt.ops.sparse_plan import sparse_plan

    plans = []

    def recorded_plan(*args, **kwargs):
        plans.append(sparse_plan(*args, **kwargs))
        return plans[-1]

    def emulated_kernel(op, config, device):
        assert op == "sparse_bwd_proxy"

        def launch(q, k, q_proxy, k_proxy, lse, lse_proxy, kl_grad, dqp_acc, dkp_acc, scale, **_):
            emulate_proxy_backward(plans[-1], q, k, q_proxy, k_proxy, lse, lse_proxy, kl_grad, scale, dqp_acc,
                                   dkp_acc)
        return launch

    monkeypatch.setattr(sparse_bwd, "sparse_plan", recorded_plan)
    monkeypatch.setattr(sparse_bwd, "get_kernel", emulated_kernel)
    return plans
