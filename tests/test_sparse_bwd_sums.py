"""The deterministic backward's fixed summation orders (flash_msa_rt.ops.sparse_bwd_sums) on CPU: the kernels'
partial rows are stood in for by random rows, and each order is checked against plain Python over the plan's lists.
Rows the kernels never write (dead slots) are NaN, so a sum that reads one fails."""

from __future__ import annotations

import pytest
import torch

from flash_msa_rt.ops import sparse_bwd_sums
from flash_msa_rt.ops.sparse_plan import live_slots, recut, sparse_plan
from tests.test_sparse_plan import random_indices


def _plan(B=2, Hp=3, S=700, K=5, Bs=128, G=2, offset=0, seed=0, tiles=2):
    gen = torch.Generator().manual_seed(seed)
    idx = random_indices(gen, B, Hp, S, K, Bs)
    return idx, sparse_plan(idx, Bs, S, G, 64 // G, tiles, query_offset=offset), gen


@pytest.mark.parametrize("offset", [0, 256])
def test_slot_sums_add_each_querys_live_slots_in_slot_order(offset):
    """The kernels store an entry's G head rows at its slot's row (entry_dest); slot_sums (the slot_sum kernel's
    statement) gives, per (b, i, p * G + g), the sum of the rows of the query's live slots, and reads no other row
    (the others are NaN here)."""
    idx, plan, gen = _plan(offset=offset)
    B, Hp, S, K = idx.shape
    G, D = plan.group, 4
    part = torch.full((plan.E, G, D), float("nan"), dtype=torch.float64)
    live = live_slots(idx, plan.block_size, offset).reshape(-1)
    dest = plan.entry_dest.long()
    written = dest[live[dest]]  # the slot rows of live entries: what the kernels write
    part[written] = torch.randn((len(written), G, D), generator=gen, dtype=torch.float64)
    got = sparse_bwd_sums.slot_sums(part.float(), idx, plan.block_size, offset)
    want = torch.zeros((B, S, Hp * G, D), dtype=torch.float32)
    for flat in range(B * Hp * S * K):
        if live[flat]:
            bp, rest = divmod(flat, S * K)
            b, p = divmod(bp, Hp)
            want[b, rest // K, p * G:(p + 1) * G] += part[flat].float()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.equal(got, want)  # the same fp32 additions in the same order


@pytest.mark.parametrize("per_head", [1, 3])
@pytest.mark.parametrize("tiles", [1, 2])
def test_item_turns_chain_the_items_of_each_key_block_in_item_order(per_head, tiles):
    """item_turns: following item_prev from an item visits every earlier real item on the same rows ((b, head
    p // per_head, block j)), each once, in descending item order; items past the real count wait for nothing
    and nothing waits for them. Also on the plan recut to the proxy kernel's tiles."""
    idx, plan, _ = _plan(tiles=tiles)
    Hp = idx.shape[1]
    for p in (plan, recut(plan, 64, 3)):
        prev, done = sparse_bwd_sums.item_turns(p.items, Hp, per_head)
        assert prev.dtype == done.dtype == torch.int32 and prev.shape == done.shape == (p.W,)
        assert not done.any()
        items = p.items.tolist()
        rows = {}
        for w, (bp, j, _, n) in enumerate(items):
            if n:
                b, hp = divmod(bp, Hp)
                rows.setdefault((b, hp // per_head, j), []).append(w)
        real = {w for ws in rows.values() for w in ws}
        for ws in rows.values():
            for before, w in zip([-1, *ws], ws):
                assert prev[w] == before
        for w in range(p.W):
            if w not in real:
                assert prev[w] == -1 and w not in prev.tolist()
        assert max(len(ws) for ws in rows.values()) > 1  # some block has several items to chain


def test_item_turns_of_a_head_chunk():
    """List-major items of a chunk plan of 2 proxy heads: with a KV head each (per_head 1) items of different
    heads or batches never wait for each other; sharing one (per_head 2), head 1's items of block 2 wait for head
    0's."""
    items = torch.tensor([[0, 2, 0, 5], [0, 2, 5, 3], [1, 2, 8, 1], [1, 3, 9, 2], [2, 2, 11, 4], [0, 0, 0, 0]],
                         dtype=torch.int32)
    assert sparse_bwd_sums.item_turns(items, 2, 1)[0].tolist() == [-1, 0, -1, -1, -1, -1]
    assert sparse_bwd_sums.item_turns(items, 2, 2)[0].tolist() == [-1, 0, 1, -1, -1, -1]


def test_accumulators_share_one_zeroed_buffer_and_cast_apart():
    """sparse_bwd.accumulators: fp32 zeros shaped like each tensor, views of one buffer at 512-byte aligned
    offsets, disjoint; cast_accumulators gives each its tensor's dtype in a storage of its own (a custom op's
    outputs may not alias)."""
    from flash_msa_rt.ops.sparse_bwd import accumulators, cast_accumulators

    like = (torch.empty(3, 5, dtype=torch.bfloat16), torch.empty(7, dtype=torch.float16),
            torch.empty(2, 2, 2, dtype=torch.bfloat16))
    flat, views = accumulators(like)
    assert flat.dtype == torch.float32 and not flat.any()
    for view, t in zip(views, like):
        assert view.shape == t.shape and view.dtype == torch.float32 and view.is_contiguous()
        assert (view.data_ptr() - flat.data_ptr()) % 512 == 0
    for n, view in enumerate(views):
        view += n + 1
    out = cast_accumulators(flat, like)
    assert [o.dtype for o in out] == [t.dtype for t in like]
    assert all(torch.equal(o, torch.full(t.shape, n + 1.0, dtype=t.dtype)) for n, (o, t) in enumerate(zip(out, like)))
    assert len({o.untyped_storage().data_ptr() for o in out}) == 3
