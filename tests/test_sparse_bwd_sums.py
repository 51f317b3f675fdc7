"""The deterministic backward's fixed-order sums (flash_msa_rt.ops.sparse_bwd_sums) on CPU: the kernels' partial
rows are stood in for by random rows, and each sum is checked against plain Python over the plan's lists. Rows the
kernels never write (dead entries, items past the real count) are filled with NaN, so a sum that reads one fails."""

from __future__ import annotations

import pytest
import torch

from flash_msa_rt.ops import sparse_bwd_sums
from flash_msa_rt.ops.sparse_plan import recut, sparse_plan
from tests.test_sparse_plan import random_indices


def _plan(B=2, Hp=3, S=700, K=5, Bs=128, G=2, offset=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = random_indices(gen, B, Hp, S, K, Bs)
    return idx, sparse_plan(idx, Bs, S, G, 64 // G, 2, query_offset=offset), gen


@pytest.mark.parametrize("offset", [0, 256])
def test_slot_sums_add_each_querys_live_entries_in_slot_order(offset):
    """sum_slots over slot_entries: per (b, p, i), the rows its live slots' entries wrote, and nothing else."""
    idx, plan, gen = _plan(offset=offset)
    B, Hp, S, K = idx.shape
    F = 6
    part = torch.randn((plan.E + 1, F), generator=gen, dtype=torch.float64)
    dest = plan.entry_dest.long()
    live = sparse_bwd_sums.live_slots(idx, plan.block_size, offset).reshape(-1)
    written = live[dest]  # plan-order rows of live entries: the ones a kernel writes
    part[:plan.E][~written] = float("nan")
    part[plan.E] = 0
    got = sparse_bwd_sums.sum_slots(part, sparse_bwd_sums.slot_entries(plan, idx))
    row_of = {d: e for e, d in enumerate(dest.tolist())}
    want = torch.zeros((B * Hp * S, F), dtype=torch.float64)
    for flat in range(B * Hp * S * K):
        if live[flat]:
            want[flat // K] += part[row_of[flat]]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("Hk", [3, 1])
def test_item_sums_add_every_item_of_a_key_block(Hk):
    """item_targets + add_items + blocks_to_rows: each (b, KV head, block) gets the sum of the items of every proxy
    head sharing that KV head, in the plan recut to other tiles too; items past the real count go to the spare
    row (their NaN rows never reach the result)."""
    idx, plan, gen = _plan()
    B, Hp, S, _ = idx.shape
    Bs, D = plan.block_size, 4
    NB = -(-S // Bs)
    for p in (plan, recut(plan, 64, 3)):
        part = torch.randn((p.W, Bs, D), generator=gen, dtype=torch.float64)
        items = p.items.tolist()
        for w, (_, _, _, n) in enumerate(items):
            if n == 0:
                part[w] = float("nan")
        blocks = torch.zeros((B * Hk * NB + 1, Bs, D), dtype=torch.float64)
        targets = sparse_bwd_sums.item_targets(p.items, Hp, Hp // Hk, 0, Hk, NB, B)
        sparse_bwd_sums.add_items(blocks, targets, part)
        got = sparse_bwd_sums.blocks_to_rows(blocks, B, Hk, S, torch.float64)
        want = torch.zeros((B, NB * Bs, Hk, D), dtype=torch.float64)
        for w, (bp, j, _, n) in enumerate(items):
            if n:
                b, hp = divmod(bp, Hp)
                want[b, j * Bs:(j + 1) * Bs, hp // (Hp // Hk)] += part[w]
        assert got.shape == (B, S, Hk, D) and got.is_contiguous()
        torch.testing.assert_close(got, want[:, :S], rtol=1e-12, atol=1e-12)


def test_item_targets_of_a_head_chunk():
    """A chunk of c proxy heads starting at KV head head0 (sparse_bwd.chunk_heads): its items land on the global
    KV head head0 + p // per_head of the whole backward's block buffer."""
    items = torch.tensor([[0, 2, 0, 5], [1, 0, 5, 3], [3, 1, 8, 1], [0, 0, 0, 0]], dtype=torch.int32)
    # c = 2 proxy heads per (b) in the chunk plan, 1 proxy head per KV head, chunk starts at KV head 4 of 8.
    got = sparse_bwd_sums.item_targets(items, 2, 1, 4, 8, 3, 2).tolist()
    assert got == [(0 * 8 + 4) * 3 + 2, (0 * 8 + 5) * 3 + 0, (1 * 8 + 5) * 3 + 1, 2 * 8 * 3]
