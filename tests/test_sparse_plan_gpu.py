"""The plan_lists kernels (kernels_src/plan_lists) on the GPU: chunk_plans on them equals chunk_plans on torch's
stable sort, field for field, on fresh random selections (dead slots, blocks past a row's own, a block every row
chose, odd S, K past the block count, K up to 64: both register widths), for chunks of heads, of queries and of
both, and for S past one bitmap window (more than 1024 blocks per tile); the scatter with CTAs of one and of four
tiles (a query chunk's boundary inside a CTA, tiles past S); key blocks of 128 and of 64."""

import pytest
import torch

from flash_msa_rt import tuning
from test_sparse_plan import random_indices

pytestmark = pytest.mark.gpu

CASES = [  # B, Hp, S, K, heads, queries
    (2, 8, 4096, 16, 8, 4096),  # one chunk
    (2, 8, 3000, 16, 2, 3000),  # chunks of heads, odd S
    (1, 4, 5000, 8, 4, 1024),  # chunks of queries, a short last one
    (2, 4, 2333, 5, 2, 896),  # chunks of heads and queries
    (1, 2, 300, 9, 1, 300),  # K past the block count
    (1, 1, 140_000, 4, 1, 140_000),  # 1094 blocks: two bitmap windows per late tile
    (1, 2, 9000, 40, 2, 9000),  # K past 16: the 64-slot variant
    (2, 2, 20_000, 64, 1, 4096),  # K = 64, chunks of heads and queries
    (1, 2, 1000, 16, 1, 128),  # chunks of one tile: four chunks in one 512-row scatter CTA
    (2, 2, 700, 1, 2, 256),  # K = 1, chunks of two tiles
    (1, 1, 100, 3, 1, 100),  # one partial tile
]


def _plans(idx, heads, queries, order, on_device, block=128):
    from flash_msa_rt.ops import sparse_plan as sp

    # Blocks of 64 sort on the kernels only where tuning.plan names them (not yet by default: this test is their
    # first check on a GPU).
    with tuning.override(plan={"lists_on_device": on_device, "list_block_sizes": (64, 128)}):
        assert (sp.lists_on_device(idx, block, 4, heads, queries) is not None) == on_device
        return sp.chunk_plans(idx, block, 4, heads, queries, ((32, 64), (64, 32)), order)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("order", ["list", "size", "query"])
@pytest.mark.parametrize("scatter_threads", [128, 512])
@pytest.mark.parametrize("block", [128, 64])
def test_plans_on_the_list_kernels_equal_the_sort(case, order, scatter_threads, block, tuned):
    tuned(plan={"scatter_threads": scatter_threads})
    B, Hp, S, K, heads, queries = case
    gen = torch.Generator().manual_seed(S * 7 + Hp + K)
    idx = random_indices(gen, B, Hp, S, K, block)
    idx[..., 0] = torch.where(torch.rand(idx.shape[:3], generator=gen) < 0.5, 0, idx[..., 0])  # a hot block 0
    idx = torch.where((idx == 0).sum(-1, keepdim=True) > 1, -1, idx)  # rows keep their blocks distinct
    idx = idx.cuda()
    got, want = _plans(idx, heads, queries, order, True, block), _plans(idx, heads, queries, order, False, block)
    assert sorted(got) == sorted(want)
    for key in want:
        for g, w in zip(got[key], want[key]):
            assert (g.E, g.W, g.NB, g.S, g.Hp, g.query_offset) == (w.E, w.W, w.NB, w.S, w.Hp, w.query_offset), key
            for field in ("entry_query", "entry_dest", "items", "item_count", "list_bounds"):
                a, b = getattr(g, field), getattr(w, field)
                assert a.dtype == b.dtype and torch.equal(a, b), (field, key)


def test_plans_on_the_list_kernels_from_a_strided_selection():
    """A selection whose slots are not contiguous (a slice of a wider one) is planned as its contiguous copy."""
    gen = torch.Generator().manual_seed(5)
    wide = random_indices(gen, 1, 4, 1500, 12, 128).cuda()
    idx = wide[..., ::2]
    got, want = _plans(idx, 2, 1500, "list", True), _plans(idx.contiguous(), 2, 1500, "list", False)
    for key in want:
        for g, w in zip(got[key], want[key]):
            assert torch.equal(g.entry_dest, w.entry_dest) and torch.equal(g.items, w.items)


@pytest.mark.parametrize("heads, queries", [(1, 5000), (2, 1024)])
def test_plans_one_head_group_at_a_time_equal_the_sort(heads, queries, tuned):
    """Past max_cells for all chunks at once, the plan kernels sort each head group's view (strided across heads)
    by itself: every chunk's plans equal the torch sort's."""
    from flash_msa_rt.ops import sparse_plan as sp

    B, Hp, S, K = 2, 4, 5000, 16
    idx = random_indices(torch.Generator().manual_seed(17), B, Hp, S, K, 128).cuda()
    group_cells = sp.chunk_keys(B, heads, S, K, heads, queries, 128).cells
    tuned(plan={"max_cells": group_cells})
    assert sp.lists_on_device(idx, 128, 4, heads, queries) is None
    assert sp.lists_on_device(idx[:, :heads], 128, 4, heads, queries) is not None
    got = sp.chunk_plans(idx, 128, 4, heads, queries, ((32, 64), (64, 32)), "query")
    with tuning.override(plan={"lists_on_device": False}):
        want = sp.chunk_plans(idx, 128, 4, heads, queries, ((32, 64), (64, 32)), "query")
    assert sorted(got) == sorted(want)
    for key in want:
        for g, w in zip(got[key], want[key]):
            assert (g.E, g.W, g.NB, g.S, g.Hp, g.query_offset) == (w.E, w.W, w.NB, w.S, w.Hp, w.query_offset), key
            for field in ("entry_query", "entry_dest", "items", "item_count", "list_bounds"):
                assert torch.equal(getattr(g, field), getattr(w, field)), (field, key)
