"""Keys longer than queries on the sparse MSA path (CPU): the plans, the kernels' emulated contracts, the merges
and the launchers with q (B, S, ...) against k, v, k_proxy (B, Sk, ...), Sk >= S. Query row i sits at key position
Sk - S + i (bottom-right causal alignment, the reference's); block indices are absolute key blocks.

Checked in float64 against the reference on the chunk (which takes longer keys itself) and against the whole
sequence's rows [Sk - S, Sk): a chunk of a sequence computes what the whole sequence computes for those rows.
"""

from __future__ import annotations

import pytest
import torch

from flash_msa_rt import reference, tuning
from flash_msa_rt.ops import sparse_bwd, sparse_fwd
from flash_msa_rt.ops import sparse_plan as sp
from flash_msa_rt.ops.partials import combine_forward, combine_kl_lse, kl_groups
from flash_msa_rt.ops.sparse_plan import live_slots, recut, sparse_plan
from flash_msa_rt.reference.selection import select_blocks
from tests.sparse_emulate import (emulate_forward, emulate_kl, emulate_main_backward, emulate_proxy_backward,
                                   emulate_proxy_backward_launches)
from tests.test_sparse_plan import assert_chunk_plans_are_sparse_plans

# (B, Sk, S, H, Hk, Hp, Hpk, D, Bs, K, tq, T): offsets inside a block, at a block edge, past several blocks, zero
CASES = {
    "off77_inside_block": (1, 300, 223, 4, 2, 2, 1, 16, 32, 4, 8, 2),
    "off_block_edge": (2, 256, 128, 8, 2, 2, 1, 8, 64, 3, 16, 1),
    "off_past_tiles_S_small": (1, 517, 19, 16, 1, 1, 1, 8, 16, 6, 8, 1),
    "G1_Hpk2": (1, 200, 131, 2, 2, 2, 2, 8, 16, 5, 4, 3),
    "off0": (1, 150, 150, 4, 1, 2, 1, 8, 16, 3, 8, 2),
}


def _inputs(case, seed):
    """The whole sequence's float64 tensors (B, Sk, ...) and the chunk's selection (its queries against every key)."""
    B, Sk, S, H, Hk, Hp, Hpk, D, Bs, K, tq, T = case
    gen = torch.Generator().manual_seed(seed)
    qp, kp, q, k, v = (torch.randn(B, Sk, h, D, generator=gen, dtype=torch.float64) for h in (Hp, Hpk, H, Hk, Hk))
    idx = select_blocks(qp[:, Sk - S:], kp, K, Bs, D ** -0.5)
    return (qp, kp, q, k, v), idx


def _chunk(x, S):
    qp, kp, q, k, v = x
    return qp[:, -S:], kp, q[:, -S:], k, v


@pytest.mark.parametrize("name", list(CASES))
def test_selection_of_a_chunk_is_the_whole_sequences_rows(name):
    """The oracle's premise: the reference selects a chunk's rows as the whole sequence does."""
    case = CASES[name]
    B, Sk, S, H, Hk, Hp, Hpk, D, Bs, K, tq, T = case
    x, idx = _inputs(case, seed=len(name))
    whole = select_blocks(x[0], x[1], K, Bs, D ** -0.5)
    assert torch.equal(idx, whole[:, :, Sk - S:])


@pytest.mark.parametrize("name", list(CASES))
def test_plan_with_a_key_offset_lists_each_rows_key_position(name):
    """The plan of a chunk at key offset off: the live rule at key positions off + i, NB = ceil(Sk / Bs), every
    live entry once with entry_query its query row, the same lists as the whole sequence's plan restricted to the
    chunk's rows."""
    case = CASES[name]
    B, Sk, S, H, Hk, Hp, Hpk, D, Bs, K, tq, T = case
    x, idx = _inputs(case, seed=len(name))
    off = Sk - S
    plan = sparse_plan(idx, Bs, S, H // Hp, tq, T, key_offset=off)
    assert (plan.NB, plan.key_offset, plan.S) == (-(-Sk // Bs), off, S)
    live = live_slots(idx, Bs, off)
    n_live = int(live.sum())
    assert int(plan.items[:, 3].sum()) == n_live
    eq, ed = plan.entry_query[:n_live].long(), plan.entry_dest[:n_live].long()
    K_ = idx.shape[3]
    assert torch.equal(eq, (ed // K_) % S)
    assert live.reshape(-1)[ed].all() and not live.reshape(-1)[plan.entry_dest[n_live:].long()].any()
    # every item's entries chose its block, and the rows are causal to it at their key positions
    for bp, j, start, n in plan.items.tolist():
        if n:
            rows = plan.entry_query[start:start + n].long()
            assert (rows == torch.sort(rows).values).all() and (j * Bs <= off + rows).all()
            assert (idx.reshape(-1)[plan.entry_dest[start:start + n].long()] == j).all()
    # the whole sequence's plan, restricted to the chunk's rows, holds the same (bp, j, row) lists
    pad = torch.full((B, Hp, off, K_), -1, dtype=torch.int32)
    whole = sparse_plan(torch.cat([pad, idx], dim=2), Bs, Sk, H // Hp, tq, T)
    assert whole.NB == plan.NB
    for field in ("list_bounds",):
        assert torch.equal(getattr(whole, field), getattr(plan, field))
    assert torch.equal(whole.entry_query[:n_live] - off, plan.entry_query[:n_live])


def _emulate_and_combine(x, idx, Bs, G, tq, T, scale):
    qp, kp, q, k, v = x
    plan = sparse_plan(idx, Bs, q.shape[1], G, tq, T, key_offset=k.shape[1] - q.shape[1])
    out, lse = combine_forward(plan, idx, *emulate_forward(plan, q, k, v, qp, kp, scale))
    lse_p, kl = combine_kl_lse(plan, idx, emulate_kl(plan, q, k, qp, kp, lse, scale))
    return out, lse, lse_p, kl


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_forward_on_a_chunk_equals_the_reference(name):
    """The forward and KL passes' contracts on a chunk (the plan's key offset, the kernels' Sk - S) merged by the
    combines: the reference's chunk results, and the whole sequence's rows."""
    case = CASES[name]
    B, Sk, S, H, Hk, Hp, Hpk, D, Bs, K, tq, T = case
    x, idx = _inputs(case, seed=len(name))
    scale = D ** -0.5
    got = _emulate_and_combine(_chunk(x, S), idx, Bs, H // Hp, tq, T, scale)
    want = reference.msa_forward(*_chunk(x, S), idx, Bs, scale)
    pad = torch.full((B, Hp, Sk - S, K), -1, dtype=torch.int32)
    whole = reference.msa_forward(*x, torch.cat([pad, idx], dim=2), Bs, scale)
    for n, g, w, full, dim in zip(("out", "lse", "lse_proxy", "kl_rows"), got, want, whole, (1, 2, 2, 2)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(g, full.narrow(dim, Sk - S, S), rtol=1e-10, atol=1e-10,
                                   msg=lambda m, n=n: f"{n} (whole sequence's rows): {m}")


def _recorded(module, name, plans):
    fn = getattr(module, name)

    def record(*args, **kwargs):
        out = fn(*args, **kwargs)
        for p in (out.values() if isinstance(out, dict) else [[out]]):
            plans.update({id(q.items): q for q in p})
        return out
    return record


@pytest.mark.parametrize("query_chunks", [False, True])
@pytest.mark.parametrize("name", ["off77_inside_block", "off_past_tiles_S_small", "off0"])
def test_forward_launcher_on_a_chunk_matches_the_reference(name, query_chunks, monkeypatch):
    """msa_forward_cuda with keys longer than queries, its four kernels replaced by their emulated contracts on
    the views they are given (the kernels' offset from the shapes): the plans carry the key offset, the merges get
    the rows' key positions (query_offset), and the results are the reference's on the chunk."""
    case = CASES[name]
    B, Sk, S, H, Hk, Hp, Hpk, D, Bs, K, tq, T = case
    x, idx = _inputs(case, seed=len(name))
    scale = D ** -0.5
    plans, last = {}, {}

    def emulated_kernel(op, config, device):
        def fwd(q, k, v, o_part, lse_part, items, scale, hp, hp_per_hk, **_):
            plan = last["fwd"] = plans[id(items)]
            assert plan.key_offset == k.shape[1] - q.shape[1]
            zeros = torch.zeros(q.shape[0], q.shape[1], hp, q.shape[3], dtype=q.dtype)  # proxy scores unused
            keys = torch.zeros(k.shape[0], k.shape[1], 1, k.shape[3], dtype=k.dtype)
            o_part[:], lse_part[:] = emulate_forward(plan, q, k, v, zeros, keys, scale)

        def combine(block_indices, o_part, lse_part, out, lse, query_offset):
            plan = last["fwd"]
            assert query_offset == plan.key_offset + plan.query_offset
            out[:], lse[:] = combine_forward(plan, block_indices, o_part, lse_part)

        def kl(q, k, q_proxy, k_proxy, lse, kl_part, items, scale, **_):
            plan = last["kl"] = plans[id(items)]
            kl_part[:] = emulate_kl(plan, q, k, q_proxy, k_proxy, lse, scale)

        def combine_kl(block_indices, kl_part, lse_proxy, kl_rows, query_offset):
            assert query_offset == last["kl"].key_offset + last["kl"].query_offset
            lse_proxy[:], kl_rows[:] = combine_kl_lse(last["kl"], block_indices, kl_part)

        return {"sparse_fwd": fwd, "sparse_combine": combine, "sparse_kl": kl, "sparse_combine_kl": combine_kl}[op]

    monkeypatch.setattr(sparse_fwd, "chunk_plans", _recorded(sp, "chunk_plans", plans))
    monkeypatch.setattr(sparse_fwd, "get_kernel", emulated_kernel)
    budget = 1 << 40
    if query_chunks:  # two or more query chunks of whole blocks
        G = H // Hp
        budget = B * Hp * K * Bs * (G * D * 2 + 4 * (G + 3 * kl_groups(Bs)))
    with tuning.override(sparse_fwd={"chunks": "queries", "partials_budget": budget}):
        got = sparse_fwd.msa_forward_cuda(*_chunk(x, S), idx, Bs, scale, arch="sm90a")
        lse_p, kl = sparse_fwd.msa_kl_cuda(*_chunk(x, S)[:4], got[1], idx, Bs, scale, arch="sm90a")
    if query_chunks and S > Bs:
        assert len({p.query_offset for p in plans.values()}) > 1
    want = reference.msa_forward(*_chunk(x, S), idx, Bs, scale)
    for n, g, w in zip(("out", "lse", "lse_proxy", "kl_rows", "msa_kl lse_proxy", "msa_kl kl_rows"),
                       (*got, lse_p, kl), (*want, want[2], want[3])):
        torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", ["off77_inside_block", "off_block_edge", "off_past_tiles_S_small", "off0"])
def test_backward_launcher_on_a_chunk_matches_the_reference(name, monkeypatch):
    """msa_backward_cuda's atomic path (bwd_delta, sparse_bwd, the proxy backward on the recut plan) with keys
    longer than queries, its kernels replaced by their emulated contracts: dq, dq_proxy on the chunk's rows and
    dk, dv, dk_proxy on every key equal the reference backward's (float64 inputs, float32 accumulators)."""
    case = CASES[name]
    B, Sk, S, H, Hk, Hp, Hpk, D, Bs, K, tq, T = case
    x, idx = _inputs(case, seed=len(name))
    scale = D ** -0.5
    chunk = _chunk(x, S)
    out, lse, lse_p, _ = reference.msa_forward(*chunk, idx, Bs, scale)
    gen = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    kl_grad = torch.rand(B, Hp, S, generator=gen, dtype=torch.float64) + 0.5
    want = reference.msa_backward(*chunk, out, lse, lse_p, idx, Bs, scale, dout, kl_grad)
    plans = {}

    def emulated_kernel(op, config, device):
        def delta(dout, out, delta):
            delta[:] = (dout.double() * out.double()).sum(-1).transpose(1, 2)

        def main(q, k, v, dout, lse, delta, items, dq_acc, dk_acc, dv_acc, scale, **_):
            plan = plans[id(items)]
            assert plan.key_offset == k.shape[1] - q.shape[1] and dk_acc.shape[1] == k.shape[1]
            emulate_main_backward(plan, q, k, v, dout, lse, delta, scale, dq_acc, dk_acc, dv_acc)

        def proxy(q, k, q_proxy, k_proxy, lse, lse_proxy, kl_grad, dqp_acc, dkp_acc, items, scale, **_):
            emulate_proxy_backward(plans[id(items)], q, k, q_proxy, k_proxy, lse, lse_proxy, kl_grad, scale,
                                   dqp_acc, dkp_acc)
        return {"bwd_delta": delta, "sparse_bwd": main, "sparse_bwd_proxy": proxy}[op]

    def recorded_plan(*args, **kwargs):
        plan = sparse_plan(*args, **kwargs)
        plans[id(plan.items)] = plan
        return plan

    def recorded_recut(*args, **kwargs):
        plan = recut(*args, **kwargs)
        plans[id(plan.items)] = plan
        return plan

    monkeypatch.setattr(sparse_bwd, "sparse_plan", recorded_plan)
    monkeypatch.setattr(sparse_bwd, "recut", recorded_recut)
    monkeypatch.setattr(sparse_bwd, "get_kernel", emulated_kernel)
    with tuning.override(sparse_bwd={"tau_path": False}):
        got = sparse_bwd.msa_backward_cuda(*chunk, out, lse, lse_p, idx, Bs, scale, dout, kl_grad, arch="sm90a")
    for n, g, w in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, n
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_proxy_backward_in_query_chunks_with_longer_keys(monkeypatch, tuned):
    """proxy_backward_cuda planning its own query chunks (plan=None) with keys longer than queries: every chunk's
    plan carries the key offset; dq_proxy and dk_proxy are the reference's (kl_grad only)."""
    case = CASES["off77_inside_block"]
    B, Sk, S, H, Hk, Hp, Hpk, D, Bs, K, tq, T = case
    x, idx = _inputs(case, seed=3)
    scale = D ** -0.5
    chunk = _chunk(x, S)
    out, lse, lse_p, _ = reference.msa_forward(*chunk, idx, Bs, scale)
    kl_grad = torch.rand(B, Hp, S, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = reference.msa_backward(*chunk, out, lse, lse_p, idx, Bs, scale, None, kl_grad)[:2]
    plans = emulate_proxy_backward_launches(monkeypatch, sparse_bwd)
    tuned(sparse_bwd={"plan_entries": B * Hp * K * 2 * Bs})  # chunks of two blocks of queries
    got = sparse_bwd.proxy_backward_cuda(chunk[0], chunk[1], chunk[2], chunk[3], lse, lse_p, idx, Bs, scale,
                                         kl_grad, arch="sm90a")
    assert len(plans) > 1 and {p.key_offset for p in plans} == {Sk - S}
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


CHUNK_CASES = [  # (B, Hp, Sk, S, K, Bs, heads, queries, batch)
    (2, 4, 300, 223, 4, 16, 2, 64, None),
    (1, 2, 517, 19, 6, 16, 1, 16, None),
    (2, 2, 700, 500, 4, 16, 1, 48, 2 * 2 * 4 * 100),  # sorted in batches of two query chunks
    (1, 2, 200, 200, 3, 16, 2, 200, None),  # offset 0
]


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunk_plans_with_a_key_offset_equal_each_chunks_own_plan(case, tuned):
    """chunk_plans(key_offset=off): each chunk's plans equal sparse_plan of that chunk's rows at query_offset s0 and
    key_offset off, field for field, for every cut (the one-chunk sort, the batched sorts)."""
    B, Hp, Sk, S, K, Bs, heads, queries, batch = case
    if batch:
        tuned(plan={"batch_entries": batch})
    gen = torch.Generator().manual_seed(Sk + S)
    qp = torch.randn(B, Sk, Hp, 8, generator=gen, dtype=torch.float64)
    idx = select_blocks(qp[:, Sk - S:], qp[:, :, :1], K, Bs, 0.3)
    off, cuts = Sk - S, ((8, 2), (3, 5))
    got = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "list", key_offset=off)
    assert_chunk_plans_are_sparse_plans(got, idx, Bs, 4, heads, queries, cuts, key_offset=off)


def test_key_offset_is_validated():
    idx = torch.zeros(1, 1, 4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="key_offset must be a non-negative int"):
        sparse_plan(idx, 16, 4, 1, 4, 1, key_offset=-1)


def test_separate_key_offsets_give_the_sparse_ops_unpadded_queries():
    """packed.per_sequence with cu_seqlens_k: the sparse MSA ops get each query sequence unpadded against a view of
    its keys (their kernels take longer keys); warmup's main attention is cuDNN's dense one: still padded."""
    from flash_msa_rt.ops import packed
    from flash_msa_rt.ops.backends import reference_impl

    assert all(packed.SPECS[op].keys_longer for op in ("select_blocks", "msa_forward", "msa_kl", "msa_backward"))
    assert not any(packed.SPECS[op].keys_longer for op in ("warmup_forward", "warmup_kl", "warmup_backward"))
    g = torch.Generator().manual_seed(3)
    Hp, H, D, BS = 2, 4, 8, 64
    k_starts, used = [0, 300], [150, 290]  # query lengths 50 and 130
    cu = torch.tensor([0, 50, 180], dtype=torch.int32)
    keys = {"cu_seqlens_k": torch.tensor(k_starts + [600], dtype=torch.int32),
            "seqused_k": torch.tensor(used, dtype=torch.int32)}
    x = [torch.randn(1, n, h, D, generator=g, dtype=torch.float64)
         for n, h in ((180, Hp), (600, 1), (180, H), (600, 2), (600, 2))]
    sel = reference_impl("select_blocks")(x[0], x[1], 3, BS, 0.3, cu, **keys)
    seen = []
    ref = reference_impl("msa_forward")

    def fixed(*a, **k):
        seen.append((a[2].shape[1], a[3].shape[1], a[5].shape[2]))
        return ref(*a, **k)

    got = packed.per_sequence("msa_forward", fixed, ref)(*x, sel, BS, 0.3, cu, **keys)
    assert seen == [(50, 150, 50), (130, 290, 130)]
    for a, b in zip(got, ref(*x, sel, BS, 0.3, cu, **keys)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
