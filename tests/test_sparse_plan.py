"""KV-outer sparse forward plumbing: the work plan, the kernel-pass emulation and the combines (CPU).

The plan is checked against lists built in plain Python; emulate + combine against the reference msa_forward on
the same block_indices (float64: 1e-10 relative; float32: a few times the reference's own float32 error). The
plan and the combines must never read a tensor value on the host: they run under FakeTensorMode.
"""

from __future__ import annotations

import collections

import pytest
import torch

import oracle
from flash_msa_rt import tuning
from tests.sparse_emulate import emulate_forward, emulate_kl
from flash_msa_rt.ops.partials import combine_forward, combine_kl_lse, kl_groups, partials_bytes
from flash_msa_rt.ops.sparse_plan import SparsePlan, live_slots, recut, sparse_plan
from flash_msa_rt.reference.msa import msa_forward
from flash_msa_rt.reference.selection import select_blocks


def random_indices(gen, B, Hp, S, K, Bs, empty=0.3):
    """Distinct random blocks per row in random slot order, earlier and later than blk(i), with -1 slots; row 0
    of every head has only empty slots or later blocks (no live slot) when there are at least two blocks."""
    nb = -(-S // Bs)
    perm = torch.rand((B, Hp, S, nb), generator=gen).argsort(dim=-1).to(torch.int32)
    idx = torch.full((B, Hp, S, K), -1, dtype=torch.int32)
    idx[..., :min(K, nb)] = perm[..., :K]
    idx = torch.where(torch.rand(idx.shape, generator=gen) < empty, torch.full_like(idx, -1), idx)
    idx = idx.gather(-1, torch.rand(idx.shape, generator=gen).argsort(dim=-1))
    if nb > 1:
        idx[:, :, 0] = torch.where(idx[:, :, 0] == 0, torch.full_like(idx[:, :, 0], -1), idx[:, :, 0])
    return idx


def expected_lists(idx, Bs):
    """{(bp, j): ascending queries} of the live entries, and {(bp, j, i): flat dest}, in plain Python."""
    B, Hp, S, K = idx.shape
    lists, dest = collections.defaultdict(list), {}
    flat = idx.reshape(-1).tolist()
    for e, j in enumerate(flat):
        bp, rest = divmod(e, S * K)
        i = rest // K
        if 0 <= j <= i // Bs:
            lists[(bp, j)].append(i)
            dest[(bp, j, i)] = e
    return dict(sorted(lists.items())), dest


def check_plan(plan: SparsePlan, idx, Bs, tq, T):
    B, Hp, S, K = idx.shape
    C = T * tq
    E, NB = B * Hp * S * K, -(-S // Bs)
    assert (plan.E, plan.NB, plan.W) == (E, NB, -(-E // C) + B * Hp * NB)
    assert plan.items.shape == (plan.W, 4) and plan.items.dtype == torch.int32
    assert plan.entry_query.shape == plan.entry_dest.shape == (E,)
    assert plan.entry_query.dtype == plan.entry_dest.dtype == torch.int32
    assert sorted(plan.entry_dest.tolist()) == list(range(E))  # a permutation of the (b, p, i, slot) grid
    lists, dest = expected_lists(idx, Bs)
    want_items, pos = [], 0
    for (bp, j), queries in lists.items():
        for c0 in range(0, len(queries), C):
            n = min(C, len(queries) - c0)
            want_items.append([bp, j, pos, n])
            pos += n
    items = plan.items.tolist()
    # Real items first, list-major, each at most C entries; then only empty rows.
    assert items[:len(want_items)] == want_items
    assert all(row == [0, 0, 0, 0] for row in items[len(want_items):])
    assert plan.item_count.tolist() == [len(want_items)]
    eq, ed = plan.entry_query.tolist(), plan.entry_dest.tolist()
    for bp, j, start, n in want_items:
        qs = eq[start:start + n]
        assert qs == sorted(set(qs)), "an item's queries are strictly ascending"
        assert [dest[(bp, j, i)] for i in qs] == ed[start:start + n]
    # Every live entry appears once (counted above by positions); the rest are the dead slots.
    live = live_slots(idx, Bs).reshape(-1)
    assert pos == int(live.sum())
    assert not live[plan.entry_dest[pos:].long()].any()
    return want_items


PLAN_CASES = {
    # (B, Hp, S, K, Bs, tq, T)
    "odd_S_random": (2, 3, 300, 4, 16, 8, 2),
    "S<Bs": (1, 2, 50, 2, 64, 4, 1),
    "K>blocks": (1, 1, 45, 9, 16, 2, 3),
    "K1_bs128": (2, 1, 300, 1, 128, 64, 1),
}


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_plan_matches_python_lists(name):
    B, Hp, S, K, Bs, tq, T = PLAN_CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    idx = random_indices(gen, B, Hp, S, K, Bs)
    check_plan(sparse_plan(idx, Bs, S, 4, tq, T), idx, Bs, tq, T)


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_recut_equals_a_fresh_plan(name):
    """The KL pass and the proxy backward recut the forward's / main backward's sorted lists into their own
    tiles: the items are those a fresh plan of those tiles gives, and meet the list contract."""
    B, Hp, S, K, Bs, tq, T = PLAN_CASES[name]
    gen = torch.Generator().manual_seed(len(name) + 1)
    idx = random_indices(gen, B, Hp, S, K, Bs)
    base = sparse_plan(idx, Bs, S, 4, tq, T, query_offset=Bs)
    for tq2, T2 in ((1, 1), (tq + 3, 2 * T + 1), (64, 16)):
        got, want = recut(base, tq2, T2), sparse_plan(idx, Bs, S, 4, tq2, T2, query_offset=Bs)
        assert (got.W, got.tile_queries, got.tiles_per_item, got.query_offset) == (want.W, tq2, T2, Bs)
        for field in ("entry_query", "entry_dest", "items", "item_count", "list_bounds"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
    check_plan(recut(sparse_plan(idx, Bs, S, 4, tq, T), 5, 2), idx, Bs, 5, 2)
    with pytest.raises(ValueError, match="tiles_per_item = 0"):
        recut(base, tq, 0)


def test_plan_of_reference_selection():
    B, S, Hp, Hpk, Dp, Bs, K = 2, 129, 2, 1, 8, 16, 3
    gen = torch.Generator().manual_seed(5)
    idx = select_blocks(oracle.randn(gen, (B, S, Hp, Dp), torch.float32),
                        oracle.randn(gen, (B, S, Hpk, Dp), torch.float32), K, Bs, Dp ** -0.5)
    items = check_plan(sparse_plan(idx, Bs, S, 2, 16, 2), idx, Bs, 16, 2)
    # The local block is always selected: every query is live at least once.
    assert sum(n for *_, n in items) >= B * Hp * S


def test_hot_block_is_split_into_bounded_items():
    """Every query picks block 0 (an attention sink) and its local block: block 0's list is S long."""
    B, Hp, S, Bs, tq, T = 1, 2, 1000, 16, 8, 2
    local = (torch.arange(S, dtype=torch.int32) // Bs).view(1, 1, S, 1).expand(B, Hp, S, 1)
    idx = torch.cat([torch.zeros_like(local), torch.where(local > 0, local, -1)], dim=-1).contiguous()
    plan = sparse_plan(idx, Bs, S, 8, tq, T)
    items = check_plan(plan, idx, Bs, tq, T)
    hot = [n for bp, j, _, n in items if j == 0]
    assert len(hot) == Hp * -(-S // (T * tq)) and max(hot) == T * tq


# --- emulate + combine against the reference ---------------------------------------------------------------------

# (B, S, H, Hk, Hp, Hpk, D, Dp, Bs, K, tq, T, selection)
CASES = {
    "G2_Hp=Hk_oddS_select": (1, 300, 4, 2, 2, 1, 16, 8, 16, 3, 16, 2, "select"),
    "G1_Hp>Hk_Hpk2_random": (2, 129, 4, 2, 4, 2, 8, 8, 16, 4, 16, 1, "random"),
    "G4_Hp>Hk_K1": (1, 77, 8, 1, 2, 1, 8, 4, 16, 1, 8, 2, "select"),
    "G8_S<Bs_K>blocks": (1, 50, 8, 2, 1, 1, 8, 8, 64, 3, 16, 1, "random"),
    "G16_K>blocks_Hpk2": (1, 100, 32, 4, 2, 2, 8, 8, 16, 9, 8, 2, "random"),
    "G2_bs128": (1, 300, 4, 2, 2, 1, 16, 8, 128, 2, 64, 1, "select"),
}


def make_inputs(case, seed):
    B, S, H, Hk, Hp, Hpk, D, Dp, Bs, K, tq, T, selection = case
    gen = torch.Generator().manual_seed(seed)
    x = {"q_proxy": oracle.randn(gen, (B, S, Hp, Dp), torch.float64),
         "k_proxy": oracle.randn(gen, (B, S, Hpk, Dp), torch.float64),
         "q": oracle.randn(gen, (B, S, H, D), torch.float64),
         "k": oracle.randn(gen, (B, S, Hk, D), torch.float64),
         "v": oracle.randn(gen, (B, S, Hk, D), torch.float64)}
    if selection == "select":
        idx = select_blocks(x["q_proxy"], x["k_proxy"], K, Bs, D ** -0.5)
    else:
        idx = random_indices(gen, B, Hp, S, K, Bs)
    return x, idx


def poison_dead_rows(plan, idx, *parts):
    """Rows of dead entries are never written by the kernel: make them NaN so a combine that reads them fails."""
    dead = ~live_slots(idx, plan.block_size).reshape(-1)
    for t in parts:
        t.masked_fill_(dead.view(-1, *([1] * (t.dim() - 1))), float("nan"))


def emulate_and_combine(x, idx, Bs, G, tq, T, scale):
    q_proxy, k_proxy, q, k, v = x.values()
    plan = sparse_plan(idx, Bs, q.shape[1], G, tq, T)
    o_part, lse_part = emulate_forward(plan, q, k, v, q_proxy, k_proxy, scale)
    poison_dead_rows(plan, idx, o_part, lse_part)
    out, lse = combine_forward(plan, idx, o_part, lse_part)
    kl_part = emulate_kl(plan, q, k, q_proxy, k_proxy, lse, scale)
    poison_dead_rows(plan, idx, kl_part)
    return (out, lse, *combine_kl_lse(plan, idx, kl_part))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_emulate_combine_equals_reference(name, dtype):
    case = CASES[name]
    B, S, H, Hk, Hp, Hpk, D, Dp, Bs, K, tq, T, _ = case
    x64, idx = make_inputs(case, seed=len(name))
    scale = D ** -0.5
    got = emulate_and_combine({n: t.to(dtype) for n, t in x64.items()}, idx, Bs, H // Hp, tq, T, scale)
    want = msa_forward(*x64.values(), idx, Bs, scale)
    base = msa_forward(*(t.float() for t in x64.values()), idx, Bs, scale) if dtype != torch.float64 else [None] * 4
    assert got[0].dtype == dtype and got[0].shape == (B, S, H, D)
    assert got[1].shape == (B, H, S) and got[2].shape == got[3].shape == (B, Hp, S)
    for n, g, w, b in zip(("out", "lse", "lse_proxy", "kl_rows"), got, want, base):
        oracle.check(n, g, w, dtype, b, factor=4.0)


def test_rows_without_live_slots_are_empty():
    """Only empty and later (causally empty) slots: out = 0, lse = lse_proxy = -inf, KL = 0, as the reference."""
    case = CASES["G1_Hp>Hk_Hpk2_random"]
    x, idx = make_inputs(case, seed=3)
    Bs = case[8]
    dead_rows = ~live_slots(idx, Bs).any(-1)  # (B, Hp, S)
    assert dead_rows.any()
    out, lse, lse_proxy, kl = emulate_and_combine(x, idx, Bs, 1, 16, 1, 8 ** -0.5)
    assert torch.equal(lse[dead_rows], torch.full_like(lse[dead_rows], float("-inf")))  # G = 1: h = p
    assert torch.equal(lse_proxy[dead_rows], lse[dead_rows]) and not kl[dead_rows].any()
    assert not out.transpose(1, 2)[dead_rows].any()


# --- no host synchronisation, validation, sizes ------------------------------------------------------------------

def test_plan_and_combines_never_sync():
    """Under FakeTensorMode every .item() / .tolist() / bool(tensor) / nonzero raises: the plan and the combines
    must be computable from shapes alone (CUDA-graph capturable)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, Hp, S, K, G, D, Bs = 2, 3, 301, 5, 4, 16, 16
    with FakeTensorMode():
        idx = torch.zeros(B, Hp, S, K, dtype=torch.int32)
        plan = sparse_plan(idx, Bs, S, G, 128 // G, 2)
        E = plan.E
        out, lse = combine_forward(plan, idx, torch.empty(E, G, D, dtype=torch.bfloat16), torch.empty(E, G))
        lse_proxy, kl = combine_kl_lse(plan, idx, torch.empty(E, 12))
    assert plan.items.shape == (plan.W, 4) and plan.entry_query.shape == (B * Hp * S * K,)
    assert out.shape == (B, S, Hp * G, D) and out.dtype == torch.bfloat16
    assert lse.shape == (B, Hp * G, S) and lse_proxy.shape == kl.shape == (B, Hp, S)
    assert lse.dtype == lse_proxy.dtype == kl.dtype == torch.float32


def test_int32_overflow_names_the_arguments():
    idx = torch.empty(1, 1, 1 << 16, 1 << 8, dtype=torch.int32, device="meta")  # E = 2**24
    sparse_plan(idx, 128, 1 << 16, 64, 2, 2)  # E * G = 2**30: fine, and shape-only on the meta device
    with pytest.raises(ValueError, match=r"block_indices .*group = 128"):
        sparse_plan(idx, 128, 1 << 16, 128, 1, 2)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"block_indices": torch.zeros(1, 1, 8, 2, dtype=torch.int64)}, ValueError, "block_indices must be int32"),
    ({"seqlen": 9}, ValueError, "seqlen = 9"),
    ({"block_size": 0}, ValueError, "block_size = 0"),
    ({"group": 2.0}, TypeError, "group must be an int"),
    ({"tile_queries": -1}, ValueError, "tile_queries = -1"),
    ({"tiles_per_item": True}, TypeError, "tiles_per_item must be an int"),
])
def test_validation(kwargs, error, match):
    args = dict(block_indices=torch.zeros(1, 1, 8, 2, dtype=torch.int32), block_size=4, seqlen=8, group=2,
                tile_queries=64, tiles_per_item=1)
    with pytest.raises(error, match=match):
        sparse_plan(**{**args, **kwargs})


def test_combine_rejects_wrong_partial_shapes():
    idx = torch.zeros(1, 1, 8, 2, dtype=torch.int32)
    plan = sparse_plan(idx, 4, 8, 2, 64, 1)
    with pytest.raises(ValueError, match=r"lse_part must have shape \(16, 2\)"):
        combine_forward(plan, idx, torch.zeros(16, 2, 8), torch.zeros(16))
    for bad in (torch.zeros(15, 3), torch.zeros(16, 4), torch.zeros(16)):  # (A, T, L) triples, E rows of them
        with pytest.raises(ValueError, match="kl_part"):
            combine_kl_lse(plan, idx, bad)


def test_partials_bytes():
    plan = sparse_plan(torch.zeros(2, 3, 10, 4, dtype=torch.int32), 4, 10, 8, 16, 1)
    E = 2 * 3 * 10 * 4
    assert partials_bytes(plan, 128, torch.bfloat16) == E * 8 * 128 * 2 + 4 * (E * 8 + E * 3)  # Bs 4: one group


@pytest.mark.gpu
def test_cuda_graph_capture_matches_eager():
    """The plan and both combines capture into one CUDA graph; replay on new indices equals eager."""
    dev = torch.device("cuda")
    B, Hp, S, K, G, D, Bs = 2, 2, 333, 4, 4, 32, 16
    gen = torch.Generator().manual_seed(11)
    idx = random_indices(gen, B, Hp, S, K, Bs).to(dev)
    E = B * Hp * S * K
    parts = [torch.randn(E, G, D, device=dev).bfloat16(), torch.randn(E, G, device=dev),
             torch.randn(E, 3, device=dev)]

    def run():
        plan = sparse_plan(idx, Bs, S, G, 128 // G, 2)
        return (plan.entry_query, plan.entry_dest, plan.items, *combine_forward(plan, idx, *parts[:2]),
                *combine_kl_lse(plan, idx, parts[2]))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    idx.copy_(random_indices(gen, B, Hp, S, K, Bs).to(dev))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, run()):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.gpu
def test_cuda_equals_cpu():
    """The plan is exact integer work: identical on CUDA; the combines agree to fp32 rounding."""
    B, Hp, S, K, G, D, Bs = 2, 3, 1001, 6, 8, 16, 16
    gen = torch.Generator().manual_seed(12)
    idx = random_indices(gen, B, Hp, S, K, Bs)
    cpu = sparse_plan(idx, Bs, S, G, 128 // G, 2)
    gpu = sparse_plan(idx.cuda(), Bs, S, G, 128 // G, 2)
    for n in ("entry_query", "entry_dest", "items", "item_count"):
        assert torch.equal(getattr(cpu, n), getattr(gpu, n).cpu()), n
    E = cpu.E
    parts = [torch.randn(E, G, D, generator=gen), torch.randn(E, G, generator=gen)]
    want = combine_forward(cpu, idx, *parts)
    got = combine_forward(gpu, idx.cuda(), *(t.cuda() for t in parts))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)


def test_query_chunks_equal_the_whole_plan():
    """The forward plans, combines and takes the KL of a chunk of queries at a time (query_offset): the chunks'
    results are the whole plan's rows (float64; tiles group other queries, so BLAS may round differently)."""
    gen = torch.Generator().manual_seed(21)
    B, S, H, Hk, Hp, Hpk, D, Bs, K = 1, 300, 4, 2, 2, 1, 16, 32, 4
    qp, kp, q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (Hp, Hpk, H, Hk, Hk))
    idx = random_indices(gen, B, Hp, S, K, Bs)
    G, scale = H // Hp, D ** -0.5

    def run(sel, s0):
        plan = sparse_plan(sel.contiguous(), Bs, sel.shape[2], G, 8, 2, query_offset=s0)
        out, lse = combine_forward(plan, sel.contiguous(), *emulate_forward(plan, q, k, v, qp, kp, scale))
        return plan, out, lse

    whole_plan, out, lse = run(idx, 0)
    lsep, kl = combine_kl_lse(whole_plan, idx, emulate_kl(whole_plan, q, k, qp, kp, lse, scale))
    for s0, s1 in ((0, 64), (64, 200), (200, 300)):
        plan, o_c, l_c = run(idx[:, :, s0:s1], s0)
        assert int(plan.entry_query.min()) >= s0 and plan.NB == -(-s1 // Bs)
        for got, want in ((o_c, out[:, s0:s1]), (l_c, lse[:, :, s0:s1])):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        lp_c, kl_c = combine_kl_lse(plan, idx[:, :, s0:s1].contiguous(), emulate_kl(plan, q, k, qp, kp, lse, scale))
        torch.testing.assert_close(lp_c, lsep[:, :, s0:s1], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(kl_c, kl[:, :, s0:s1], rtol=1e-12, atol=1e-14)


def test_forward_query_chunk_fits_the_budget():
    from flash_msa_rt.ops.sparse_fwd import CHUNK_SLACK, choice, query_chunk

    def policy_chunk(B, S, Hp, K, G, D, Bs):  # the chunk under the tuning policy's budget for these sizes
        return query_chunk(B, S, Hp, K, G, D, Bs, choice("sm90a", G, D, Bs, B, S, Hp * G).partials_budget)

    least = choice("sm90a", 4).partials_budget  # no sizes: the policy's floor
    assert least == 2 << 30
    # Configuration (b) at 128K tokens: the whole selection's partials would take ~17 GB; a chunk's may take as
    # much as the backward's fp32 dq accumulator (2 GiB here).
    B, S, Hp, K, G, D = 2, 65536, 8, 16, 4, 128
    budget = 4 * B * S * Hp * G * D
    chunk = policy_chunk(B, S, Hp, K, G, D, 128)
    per_query = B * Hp * K * (G * D * 2 + 4 * (G + 12))
    assert budget >= least
    # equal chunks, none over the budget by more than the slack, and no more of them than full ones would take
    full = budget // per_query // 128 * 128
    assert chunk % 128 == 0 and chunk * per_query <= budget * (1 + CHUNK_SLACK)
    assert (S + chunk - 1) // chunk <= (S + full - 1) // full and S % chunk == 0, (chunk, full)
    assert (S + chunk - 1) // chunk == 8  # 9 full chunks would leave a 2.5K-query tail
    # Smaller problems keep the least budget (configuration (a) at 16K tokens: dq would take 128 MiB); the chunk
    # that fits leaves 640 queries, so one chunk takes them all, within the slack.
    chunk = policy_chunk(1, 16384, 4, K, 4, D, 128)
    per_query = 4 * K * (4 * D * 2 + 4 * (4 + 12))
    assert chunk == 16384 and chunk * per_query <= least * (1 + CHUNK_SLACK)
    assert policy_chunk(1, 300, 1, 1, 1, 128, 128) == 384  # small problems: one chunk covering every block
    assert query_chunk(B, S, Hp, K, G, D, 128, budget=1) == 128  # at least one block per chunk
    # chunks as equal as whole blocks allow: 9 blocks that fit 4 per chunk run as 3 + 3 + 3, not 4 + 4 + 1
    four_blocks = 4 * 128 * (128 * 2 + 4 * 13)
    assert query_chunk(1, 9 * 128, 1, 1, 1, 128, 128, budget=four_blocks) == 3 * 128
    assert query_chunk(1, 8 * 128 + 1, 1, 1, 1, 128, 128, budget=four_blocks) == 3 * 128  # 9 blocks, the last partial


def test_warmup_kl_pass_in_query_chunks_matches_the_reference(monkeypatch, tuned):
    """Warmup's KL pass (sparse_fwd.msa_kl_cuda over every causal block, given the main lse) in several query
    chunks, with the kernel replaced by its emulated contract: lse_proxy and kl_rows are the reference warmup
    forward's (float64)."""
    from flash_msa_rt import reference
    from flash_msa_rt.ops import kernels, sparse_fwd

    gen = torch.Generator().manual_seed(31)
    B, S, H, Hk, Hp, Hpk, D = 2, 300, 4, 2, 2, 1, 16
    qp, kp, q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (Hp, Hpk, H, Hk, Hk))
    scale = D ** -0.5
    _, lse, want_lsep, want_kl = reference.warmup_forward(qp, kp, q, k, v, scale)

    plans = []

    def recorded_plan(*args, **kwargs):
        plans.append(sparse_plan(*args, **kwargs))
        return plans[-1]

    def emulated_kernel(op, config, device):
        assert op in ("sparse_kl", "sparse_combine_kl")

        def launch(lse, kl_part, q, k, q_proxy, k_proxy, scale, **_):
            kl_part.copy_(emulate_kl(plans[-1], q, k, q_proxy, k_proxy, lse, scale))

        def merge(block_indices, kl_part, lse_proxy, kl_rows, query_offset):  # the merge kernel's torch statement
            assert query_offset == plans[-1].query_offset
            lse_proxy[:], kl_rows[:] = combine_kl_lse(plans[-1], block_indices, kl_part)
        return launch if op == "sparse_kl" else merge

    monkeypatch.setattr(sparse_fwd, "sparse_plan", recorded_plan)
    monkeypatch.setattr(sparse_fwd, "get_kernel", emulated_kernel)
    # three chunks of 128 queries: the budget holds one chunk's (A, T, L) partials
    tuned(sparse_fwd={"kl_partials_budget": B * Hp * 3 * 4 * 3 * kl_groups(128) * 128})
    sel = kernels.AllCausalBlocks(qp, kernels.WARMUP_BLOCK)  # rows made per chunk, as warmup runs it
    lsep, kl = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, kernels.WARMUP_BLOCK, scale)
    assert len(plans) == 3 and [int(p.entry_query.min()) for p in plans] == [0, 128, 256]
    torch.testing.assert_close(lsep, want_lsep.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl, want_kl.float(), rtol=1e-5, atol=1e-6)


def test_warmup_proxy_backward_in_query_chunks_matches_the_reference(monkeypatch, tuned):
    """Warmup's proxy backward (sparse_bwd.proxy_backward_cuda over every causal block) in several query chunks,
    with the kernel replaced by its emulated contract: dq_proxy and dk_proxy are the reference warmup backward's
    (float64)."""
    from flash_msa_rt import reference
    from flash_msa_rt.ops import kernels, sparse_bwd
    from tests.sparse_emulate import emulate_proxy_backward_launches

    gen = torch.Generator().manual_seed(32)
    B, S, H, Hk, Hp, Hpk, D = 2, 300, 4, 2, 2, 1, 16
    qp, kp, q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (Hp, Hpk, H, Hk, Hk))
    kl_grad = torch.rand(B, Hp, S, generator=gen, dtype=torch.float64) + 0.5
    scale = D ** -0.5
    out, lse, lse_p, _ = reference.warmup_forward(qp, kp, q, k, v, scale)
    want = reference.warmup_backward(qp, kp, q, k, v, out, lse, lse_p, scale, torch.zeros_like(q), kl_grad)[:2]

    plans = emulate_proxy_backward_launches(monkeypatch, sparse_bwd)
    tuned(sparse_bwd={"plan_entries": B * Hp * 3 * 128})  # chunks of 128 queries (3 blocks each)
    got = sparse_bwd.proxy_backward_cuda(qp, kp, q, k, lse, lse_p, kernels.AllCausalBlocks(qp, kernels.WARMUP_BLOCK),
                                         kernels.WARMUP_BLOCK, scale, kl_grad)
    assert len(plans) == 3 and [int(p.entry_query.min()) for p in plans] == [0, 128, 256]
    for g, w in zip(got, want):  # float32 accumulators and kl_grad, as the kernel's: float32 rounding
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
def test_runtime_items_fit_the_backward_entry_table(G):
    """sparse_bwd stages an item's entries in a shared table of ENTRY_TABLE (entries past it take a slower global
    read): the runtime's items, a hot block's longest ones included, must fit it at every G."""
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.tuning.sparse_bwd import ITEM_ENTRIES
    from kernels_src.sparse_bwd import ENTRY_TABLE

    B, Hp, Bs = 1, 1, 128
    assert ITEM_ENTRIES == ENTRY_TABLE
    T = sb.choice("sm90a", G).tiles_per_item
    S = 2 * Bs * T * sb.TILE_M // G  # block 0's list: two full items and more
    local = (torch.arange(S, dtype=torch.int32) // Bs).view(1, 1, S, 1).expand(B, Hp, S, 1)
    idx = torch.cat([torch.zeros_like(local), torch.where(local > 0, local, -1)], dim=-1).contiguous()
    plan = sparse_plan(idx, Bs, S, G, sb.TILE_M // G, T)
    longest = int(plan.items[:, 3].max())
    assert longest == T * sb.TILE_M // G <= ENTRY_TABLE


CHUNK_CASES = [  # (B, Hp, S, K, Bs, heads, queries, batch entries)
    (2, 3, 300, 4, 16, 3, 64, None),  # query chunks, an odd last one
    (1, 4, 333, 5, 32, 2, 96, None),  # head and query chunks
    (2, 4, 200, 3, 16, 1, 1000, None),  # head chunks only
    (3, 6, 150, 4, 16, 2, 150, None),  # head chunks of two heads, three sequences
    (1, 2, 45, 9, 16, 2, 45, None),  # one chunk, K > blocks
    (2, 2, 500, 4, 16, 1, 48, 2 * 2 * 4 * 100),  # sorted in batches of two query chunks
]


def assert_chunk_plans_are_sparse_plans(got, idx, Bs, group, heads, queries, cuts, key_offset=0) -> list:
    """chunk_plans' result `got` against sparse_plan of each chunk's rows, field for field, for every cut; returns
    the chunk starts (p0, s0)."""
    Hp, S = idx.shape[1], idx.shape[2]
    starts = [(p0, s0) for p0 in range(0, Hp, heads) for s0 in range(0, S, queries)]
    assert sorted(got) == sorted(starts)
    for p0, s0 in starts:
        s1 = min(S, s0 + queries)
        sel = idx[:, p0:p0 + heads, s0:s1].contiguous()
        for (tq, T), plan in zip(cuts, got[(p0, s0)]):
            want = sparse_plan(sel, Bs, s1 - s0, group, tq, T, query_offset=s0, key_offset=key_offset)
            for field in ("E", "W", "K", "Hp", "S", "B", "NB", "block_size", "group", "tile_queries",
                          "tiles_per_item", "query_offset", "key_offset"):
                assert getattr(plan, field) == getattr(want, field), (field, p0, s0)
            for field in ("entry_query", "entry_dest", "items", "item_count", "list_bounds"):
                g, w = getattr(plan, field), getattr(want, field)
                assert g.dtype == w.dtype and torch.equal(g, w), (field, p0, s0, tq, T)
    return starts


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunk_plans_equal_each_chunks_own_plan(case, tuned):
    """chunk_plans sorts every chunk at once; each chunk's plans equal sparse_plan / recut of that chunk's rows
    field for field, for every tile cut, including the batched sorts of long sequences."""
    from flash_msa_rt.ops import sparse_plan as sp

    B, Hp, S, K, Bs, heads, queries, batch = case
    if batch:
        tuned(plan={"batch_entries": batch})
    gen = torch.Generator().manual_seed(S + Hp)
    idx = random_indices(gen, B, Hp, S, K, Bs)
    cuts = ((8, 2), (3, 5), (64, 1))
    got = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "list")
    by_size = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "size")  # the same items, longest first
    tuned(plan={"query_bin": 32})
    by_query = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "query")  # the same items, by (bp, query bin)
    for p0, s0 in assert_chunk_plans_are_sparse_plans(got, idx, Bs, 4, heads, queries, cuts):
        sel = idx[:, p0:p0 + heads, s0:min(S, s0 + queries)].contiguous()
        for plan, sized in zip(got[(p0, s0)], by_size[(p0, s0)]):
            n = plan.items[:, 3].long()
            longest = sorted(range(plan.W), key=lambda w: (-int(n[w]), w))  # stable: list order among equals
            assert torch.equal(sized.items, plan.items[longest]), (p0, s0)
            assert torch.equal(sized.item_count, plan.item_count) and torch.equal(sized.entry_dest, plan.entry_dest)
        for plan, binned in zip(got[(p0, s0)], by_query[(p0, s0)]):
            items, real = plan.items.tolist(), int(plan.item_count)
            first = [int(plan.entry_query[start]) if n else 0 for _, _, start, n in items]
            want = sorted(range(real), key=lambda w: (items[w][0], first[w] // 32, w)) + list(range(real, plan.W))
            assert torch.equal(binned.items, plan.items[want]), (p0, s0)
            assert torch.equal(binned.item_count, plan.item_count) and torch.equal(binned.entry_dest, plan.entry_dest)
        if s0 == 0:
            check_plan(got[(p0, s0)][0], sel, Bs, *cuts[0])


@pytest.mark.parametrize("case", CHUNK_CASES)
@pytest.mark.parametrize("bin_queries", [16, 40, 4096])
def test_chunk_plans_in_bins(case, bin_queries, tuned):
    """Item order "bins": each chunk's list (bp, j) cut at the chunk's query bins [s0 + m Q, s0 + (m + 1) Q), each
    piece cut into items of at most C entries, the items in (bp, m, j) order; the sorted entries are the list
    order's, the real items fit W, and every live entry is in exactly one item."""
    from flash_msa_rt.ops import sparse_plan as sp

    B, Hp, S, K, Bs, heads, queries, batch = case
    if batch:
        tuned(plan={"batch_entries": batch})
    idx = random_indices(torch.Generator().manual_seed(S + 5 * Hp), B, Hp, S, K, Bs)
    cuts = ((8, 2), (3, 5))
    listed = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "list")
    got = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "bins", bin_queries=bin_queries)
    assert sorted(got) == sorted(listed)
    for key in listed:
        s0 = key[1]
        for plan, binned, (tq, T) in zip(listed[key], got[key], cuts):
            C = tq * T
            assert torch.equal(binned.entry_query, plan.entry_query) and torch.equal(binned.entry_dest, plan.entry_dest)
            bounds, q = plan.list_bounds.tolist(), plan.entry_query.tolist()
            want = []
            for bp in range(plan.B * plan.Hp):
                for m in range(-(-plan.S // bin_queries)):
                    for j in range(plan.NB):
                        lo, hi = bounds[bp * plan.NB + j], bounds[bp * plan.NB + j + 1]
                        rows = [e for e in range(lo, hi) if s0 + m * bin_queries <= q[e] < s0 + (m + 1) * bin_queries]
                        assert rows == list(range(rows[0], rows[0] + len(rows))) if rows else True
                        want += [[bp, j, rows[c], min(C, len(rows) - c)] for c in range(0, len(rows), C)]
            real = int(binned.item_count)
            assert real == len(want) <= binned.W == binned.items.shape[0], (key, real, len(want), binned.W)
            assert binned.items[:real].tolist() == want, key
            assert not binned.items[real:].any()


def test_chunk_plans_never_sync():
    """chunk_plans runs under FakeTensorMode (shapes only: capturable, no host read of a device value)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_msa_rt.ops.sparse_plan import chunk_plans

    with FakeTensorMode():
        idx = torch.zeros(2, 4, 301, 5, dtype=torch.int32)
        plans = chunk_plans(idx, 16, 4, 2, 128, ((32, 2), (64, 4)))
        binned = chunk_plans(idx, 16, 4, 2, 128, ((32, 2), (64, 4)), "bins", bin_queries=48)
    assert sorted(binned) == sorted(plans)
    assert sorted(plans) == [(0, 0), (0, 128), (0, 256), (2, 0), (2, 128), (2, 256)]
    plan, kl_plan = plans[(2, 256)]
    assert plan.E == 2 * 2 * 45 * 5 and plan.items.shape == (plan.W, 4) and kl_plan.tile_queries == 64


def test_chunk_plans_reject_misaligned_chunks():
    from flash_msa_rt.ops.sparse_plan import chunk_plans

    idx = torch.zeros(1, 4, 300, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="heads = 3 must divide Hp = 4"):
        chunk_plans(idx, 16, 2, 3, 64, ((8, 1),))
    with pytest.raises(ValueError, match="queries = 40 .* multiple of block_size = 16"):
        chunk_plans(idx, 16, 2, 2, 40, ((8, 1),))


@pytest.mark.parametrize("chunks, budget_heads, Hk, Hpk, heads, query_chunks", [
    ("heads", 1.1, 2, 1, 1, False),  # one proxy head per chunk, two sharing a KV head
    ("heads", 2.3, 2, 2, 2, False),  # two proxy heads per chunk on one KV head and one proxy key head
    ("heads", 0.5, 4, 1, 1, True),  # one head per chunk, its queries in chunks too
    ("queries", 1.1, 2, 1, 4, True),  # every head, queries in chunks
])
def test_forward_chunks_match_the_reference(chunks, budget_heads, Hk, Hpk, heads, query_chunks, monkeypatch):
    """msa_forward_cuda's chunking (heads first or queries, head-sliced views, every chunk planned by chunk_plans)
    with the four kernels replaced by their emulated contracts on the views they are given: out, lse, lse_proxy and
    kl_rows are the reference forward's (float64 inputs; lse and the KL land in the launcher's float32 buffers)."""
    from flash_msa_rt import reference
    from flash_msa_rt.ops import sparse_fwd
    from flash_msa_rt.ops import sparse_plan as sp

    gen = torch.Generator().manual_seed(40 + heads + 2 * query_chunks)
    B, S, H, Hp, D, K, Bs = 2, 700, 16, 4, 16, 4, 128
    G, scale = H // Hp, D ** -0.5
    qp, kp, q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (Hp, Hpk, H, Hk, Hk))
    idx = random_indices(gen, B, Hp, S, K, Bs)
    plans = {}  # id(items) -> plan, for the emulated kernels to find the plan they were launched with

    def recorded_chunk_plans(*args, **kwargs):
        out = sp.chunk_plans(*args, **kwargs)
        plans.update({id(p.items): p for chunk in out.values() for p in chunk})
        return out

    last = {}

    def emulated_kernel(op, config, device):
        def fwd(q, k, v, o_part, lse_part, items, scale, hp, hp_per_hk, **_):
            plan = last["fwd"] = plans[id(items)]
            assert hp == plan.Hp and k.shape[2] * hp_per_hk == hp
            zeros = torch.zeros(q.shape[0], q.shape[1], hp, q.shape[3], dtype=q.dtype)  # proxy scores unused
            o_part[:], lse_part[:] = emulate_forward(plan, q, k, v, zeros, zeros[:, :, :1], scale)

        def combine(block_indices, o_part, lse_part, out, lse, query_offset):
            plan = last["fwd"]
            assert query_offset == plan.query_offset
            out[:], lse[:] = combine_forward(plan, block_indices, o_part, lse_part)

        def kl(q, k, q_proxy, k_proxy, lse, kl_part, items, scale, hp_per_hk, hp_per_hpk, **_):
            plan = last["kl"] = plans[id(items)]
            Hpc = q_proxy.shape[2]
            assert k.shape[2] * hp_per_hk == Hpc and k_proxy.shape[2] * hp_per_hpk == Hpc
            kl_part[:] = emulate_kl(plan, q, k, q_proxy, k_proxy, lse, scale)

        def combine_kl(block_indices, kl_part, lse_proxy, kl_rows, query_offset):
            lse_proxy[:], kl_rows[:] = combine_kl_lse(last["kl"], block_indices, kl_part)

        return {"sparse_fwd": fwd, "sparse_combine": combine, "sparse_kl": kl, "sparse_combine_kl": combine_kl}[op]

    monkeypatch.setattr(sparse_fwd, "chunk_plans", recorded_chunk_plans)
    monkeypatch.setattr(sparse_fwd, "get_kernel", emulated_kernel)
    per_head = B * S * K * (G * D * 2 + 4 * (G + 3 * kl_groups(Bs)))
    budget = int(budget_heads * per_head)
    c, queries = sparse_fwd.forward_chunks(B, S, Hp, Hk, Hpk, K, G, D, Bs, budget, chunks)
    assert (c, queries < S) == (heads, query_chunks)
    with tuning.override(sparse_fwd={"chunks": chunks, "partials_budget": budget}):
        got = sparse_fwd.msa_forward_cuda(qp, kp, q, k, v, idx, Bs, scale)
    assert len({p.query_offset for p in plans.values()}) == -(-S // queries)
    # Against one chunk of the same emulated pipeline (tiles group other queries, so BLAS may round differently),
    # and that against the reference: lse and kl_rows are float32 buffers, and the KL pass reads the float32 lse
    # (KL = ln 2 sum A + lse_p sum T cancels: ~eps32 |lse|).
    assert sparse_fwd.forward_chunks(B, S, Hp, Hk, Hpk, K, G, D, Bs, 1 << 40, chunks) == (Hp, -(-S // Bs) * Bs)
    with tuning.override(sparse_fwd={"chunks": chunks, "partials_budget": 1 << 40}):
        whole = sparse_fwd.msa_forward_cuda(qp, kp, q, k, v, idx, Bs, scale)
    want = reference.msa_forward(qp, kp, q, k, v, idx, Bs, scale)
    for name, g, one, w in zip(("out", "lse", "lse_proxy", "kl_rows"), got, whole, want):
        torch.testing.assert_close(g, one, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(one.double(), w, rtol=1e-6, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("D", [64, 128])
def test_runtime_combine_heads_are_built(D):
    """The tuning policy asks for the build's widest heads per warp (the runtime does not import kernels_src):
    every G it asks for must be a variant the catalogue builds and the kernel accepts."""
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.tuning.sparse_fwd import COMBINE_LANE_ELEMENTS
    from kernels_src import sparse_combine as sc

    assert COMBINE_LANE_ELEMENTS == sc.LANE_ELEMENTS
    built = {(c.group, c.heads_per_warp) for c in sc.configs(head_dims=(D,))}
    for G in (1, 2, 4, 8, 16):
        hw = sf.choice("sm90a", G, D).combine_heads
        assert hw == sc.widest_heads(G, D) and (G, hw) in built and (G, 1) in built
        assert sc.can_implement(sc.Config(head_dim=D, group=G, heads_per_warp=hw), "sm90a")[0]
        assert hw * D // 32 <= sc.LANE_ELEMENTS and (hw == G or hw * D // 32 == sc.LANE_ELEMENTS)


@pytest.mark.parametrize("case", CHUNK_CASES[:5])
@pytest.mark.parametrize("order", ["list", "size", "query", "bins"])
@pytest.mark.parametrize("n_cuts", [2, 3])  # 3: more than one plan_items launch makes (the torch cut)
def test_chunk_plans_on_the_list_kernels_equal_the_sort(case, order, n_cuts, tuned):
    """The plan kernels' contracts (sparse_emulate.plan_lists_kernels, tile by tile and list by list as the kernels
    run, on tiles of 16 rows so that these chunks are whole tiles) give chunk_plans' plans field for field: the key
    layout, the ranks, the dead entries' places, the lists table and the items all agree with the torch sort's."""
    from flash_msa_rt.ops import sparse_plan as sp
    from tests.sparse_emulate import plan_lists_kernels

    B, Hp, S, K, Bs, heads, queries, _ = case
    tuned(plan={"tile_rows": 16, "query_bin": 32})
    gen = torch.Generator().manual_seed(S + Hp + 7)
    idx = random_indices(gen, B, Hp, S, K, Bs)
    cuts = ((8, 2), (3, 5), (64, 1))[:n_cuts]
    bins = {"bin_queries": 32} if order == "bins" else {}
    want = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, order, **bins)
    got = sp._kernel_plans(idx, Bs, 4, heads, queries, cuts, order, kernels=plan_lists_kernels(Bs, tile_rows=16),
                           **bins)
    assert sorted(got) == sorted(want)
    for key in want:
        for g, w in zip(got[key], want[key]):
            for field in ("E", "W", "K", "Hp", "S", "B", "NB", "block_size", "group", "tile_queries",
                          "tiles_per_item", "query_offset"):
                assert getattr(g, field) == getattr(w, field), (field, key)
            for field in ("entry_query", "entry_dest", "items", "item_count", "list_bounds"):
                a, b = getattr(g, field), getattr(w, field)
                assert a.dtype == b.dtype and torch.equal(a, b), (field, key)


def test_chunk_keys_are_the_kernels():
    """The host's key layout (chunk_keys) counts the keys the kernels' closed forms index: the last chunk's dead
    keys end at keys, every chunk's lists start where the one before ended."""
    from flash_msa_rt.ops.sparse_plan import chunk_keys

    B, Hp, S, K, Bs, heads, queries = 2, 4, 1000, 3, 64, 2, 384
    ck = chunk_keys(B, Hp, S, K, heads, queries, Bs)
    n_q, nbq, bc = ck.n_q, queries // Bs, B * heads
    per_group = bc * (nbq * (n_q - 1) * n_q // 2 + -(-S // Bs) + n_q)
    bases = [hg * per_group + bc * (nbq * qc * (qc + 1) // 2 + qc) for hg in range(Hp // heads) for qc in range(n_q)]
    sizes = [L + bc for L in ck.L]
    assert bases == [sum(sizes[:n]) for n in range(len(sizes))] and ck.keys == sum(sizes)
    assert ck.tiles == 3 and ck.NB == [6, 12, 16] * 2 and ck.E == [bc * 384 * K, bc * 384 * K, bc * 232 * K] * 2


def test_chunk_plans_takes_the_kernel_path_with_its_chunk_keys(monkeypatch, tuned):
    """chunk_plans routes to the plan kernels with the ChunkKeys lists_on_device gave (here on CPU, the kernels
    emulated): the plans equal the torch sort's."""
    from flash_msa_rt.ops import sparse_plan as sp
    from tests.sparse_emulate import plan_lists_kernels

    B, Hp, S, K, Bs, heads, queries = 2, 4, 333, 5, 32, 2, 96
    idx = random_indices(torch.Generator().manual_seed(3), B, Hp, S, K, Bs)
    cuts = ((8, 2), (3, 5))
    want = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "list")
    tuned(plan={"tile_rows": 16})
    ck, given = sp.chunk_keys(B, Hp, S, K, heads, queries, Bs), []
    monkeypatch.setattr(sp, "lists_on_device", lambda *a: given.append(ck) or ck)
    monkeypatch.setattr(sp, "_lists_kernels", lambda *a: plan_lists_kernels(Bs, tile_rows=16))
    monkeypatch.setattr(sp, "chunk_keys", lambda *a: pytest.fail("chunk keys computed twice"))
    got = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "list")
    assert len(given) == 1 and sorted(got) == sorted(want)
    for key in want:
        for g, w in zip(got[key], want[key]):
            assert torch.equal(g.items, w.items) and torch.equal(g.entry_dest, w.entry_dest), key


def test_a_kept_selection_is_sorted_once_for_its_backward(monkeypatch, tuned):
    """chunk_plans(keep_lists=True) (the MSA forward's) leaves its sorted lists on the selection tensor: the next
    plan of the same selection and chunks that takes lists (the backward's, on other cuts) takes them instead of
    sorting and gets the plans the sort gives. A plan that does not take (another forward), a write to the
    selection, other chunks, a plan after the one that took them, or more entries than keep_lists_entries sort
    again."""
    from flash_msa_rt.ops import sparse_plan as sp
    from tests.sparse_emulate import plan_lists_kernels

    B, Hp, S, K, Bs = 2, 4, 333, 5, 32
    idx = random_indices(torch.Generator().manual_seed(5), B, Hp, S, K, Bs)
    tuned(plan={"tile_rows": 16})
    sorts = []
    sort = sp.sorted_lists_on_device
    monkeypatch.setattr(sp, "lists_on_device", lambda sel, bs, g, heads, queries: sp.chunk_keys(
        *sel.shape, heads, queries, bs))
    monkeypatch.setattr(sp, "_lists_kernels", lambda *a: plan_lists_kernels(Bs, tile_rows=16))
    monkeypatch.setattr(sp, "sorted_lists_on_device", lambda *a: sorts.append(a[3]) or sort(*a))
    forward_cuts, backward_cuts = ((8, 2), (3, 5)), ((4, 3), (16, 1))

    def forward(sel):
        return sp.chunk_plans(sel, Bs, 4, Hp, S, forward_cuts, "size", keep_lists=True)

    def backward(sel, queries=S):
        return sp.chunk_plans(sel, Bs, 4, Hp, queries, backward_cuts, "list", take_lists=True)

    forward(idx)
    got = backward(idx, queries=10 * S)  # one chunk of queries either way
    assert len(sorts) == 1
    want = backward(idx.clone())
    assert len(sorts) == 2 and sorted(got) == sorted(want)
    for key in want:
        for g, w in zip(got[key], want[key]):
            for field in ("entry_query", "entry_dest", "items", "item_count", "list_bounds"):
                assert torch.equal(getattr(g, field), getattr(w, field)), (field, key)
    backward(idx)  # taken by the plan before
    assert len(sorts) == 3
    forward(idx)
    forward(idx)  # a forward never takes
    assert len(sorts) == 5
    idx[0, 0, -1, 0] = 0  # a write through torch bumps the version counter
    backward(idx)
    assert len(sorts) == 6
    forward(idx)
    backward(idx, queries=96)  # other chunks: other lists
    assert len(sorts) == 8
    tuned(plan={"tile_rows": 16, "keep_lists_entries": B * Hp * S * K - 1})
    forward(idx)
    backward(idx)
    assert len(sorts) == 10 and not hasattr(idx, sp._KEPT_LISTS)


@pytest.mark.parametrize("queries", [96, 1000])  # chunks of heads and queries; of heads only
def test_chunk_plans_sort_one_head_group_at_a_time_past_max_cells(queries, monkeypatch, tuned):
    """Where all chunks' count matrices would pass tuning.plan's max_cells but one head group's fit, chunk_plans
    sorts each group of `heads` proxy heads on the plan kernels (here emulated on CPU) by itself: one sort per
    group, and every chunk's plans equal the torch sort's field for field, under the whole selection's keys."""
    from flash_msa_rt.ops import sparse_plan as sp
    from tests.sparse_emulate import plan_lists_kernels

    B, Hp, S, K, Bs, heads = 2, 6, 333, 5, 32, 2
    idx = random_indices(torch.Generator().manual_seed(11), B, Hp, S, K, Bs)
    cuts = ((8, 2), (3, 5))
    want = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "size")
    tuned(plan={"tile_rows": 16})
    group_cells = sp.chunk_keys(B, heads, S, K, heads, queries, Bs).cells
    tuned(plan={"tile_rows": 16, "max_cells": group_cells})
    assert sp.chunk_keys(B, Hp, S, K, heads, queries, Bs).cells > group_cells

    def on_device(sel, bs, group, h, q):  # lists_on_device's fit test, as on CUDA tensors
        ck = sp.chunk_keys(*sel.shape, h, q, bs)
        return ck if ck.cells <= sp.tuning_plan.choose("").max_cells else None

    sorts = []
    sort = sp.sorted_lists_on_device
    monkeypatch.setattr(sp, "lists_on_device", on_device)
    monkeypatch.setattr(sp, "_lists_kernels", lambda *a: plan_lists_kernels(Bs, tile_rows=16))
    monkeypatch.setattr(sp, "sorted_lists_on_device", lambda *a: sorts.append(a[0].shape) or sort(*a))
    got = sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "size", keep_lists=True)
    assert sorts == [(B, heads, S, K)] * (Hp // heads) and not hasattr(idx, sp._KEPT_LISTS)
    assert sorted(got) == sorted(want)
    for key in want:
        for g, w in zip(got[key], want[key]):
            for field in ("E", "W", "K", "Hp", "S", "B", "NB", "tile_queries", "tiles_per_item", "query_offset"):
                assert getattr(g, field) == getattr(w, field), (field, key)
            for field in ("entry_query", "entry_dest", "items", "item_count", "list_bounds"):
                assert torch.equal(getattr(g, field), getattr(w, field)), (field, key)
    tuned(plan={"tile_rows": 16, "max_cells": group_cells - 1})  # not even one group fits: the torch sort
    sp.chunk_plans(idx, Bs, 4, heads, queries, cuts, "size")
    assert len(sorts) == Hp // heads


def test_device_lists_sort_only_the_block_sizes_the_plan_policy_names(tuned):
    """chunk_plans sorts on the plan_lists kernels at the block sizes tuning.plan names (64 and 128, checked on a
    GPU by tests/test_sparse_plan_gpu.py), and every one of them is a size the build makes
    (kernels_src.plan_lists.BLOCK_SIZES)."""
    import types

    from flash_msa_rt.ops import sparse_plan as sp
    from kernels_src import plan_lists

    on_gpu = types.SimpleNamespace(is_cuda=True, shape=(1, 2, 1000, 16))  # lists_on_device reads no values
    assert set(tuning.plan.choose("").list_block_sizes) <= set(plan_lists.BLOCK_SIZES)
    assert sp.lists_on_device(on_gpu, 128, 4, 2, 1000) is not None
    assert sp.lists_on_device(on_gpu, 64, 4, 2, 1000) is not None
    tuned(plan={"list_block_sizes": (128,)})
    assert sp.lists_on_device(on_gpu, 64, 4, 2, 1000) is None
