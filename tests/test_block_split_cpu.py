"""D 256's selections as the main kernels take them (flash_msa_rt.ops.block_split): a block of 128 is its two halves
of 64, on the device, without changing what is attended. Checked on the CPU: the split itself, the float64
reference over the split equal to the reference over the original (forward and backward, keys longer than queries,
empty slots), the plan's live entries (no half without a causal key), and the split kept on the selection object
for the eager path only."""

import pytest
import torch

from flash_msa_rt.ops import block_split, sparse_plan
from flash_msa_rt.reference import msa as ref
from flash_msa_rt.tuning.head_dim import gather_stages, kernel_block_size, row_threads


def test_the_rules_at_each_head_dim():
    assert [kernel_block_size(d, bs) for d in (64, 128, 256) for bs in (64, 128)] == [64, 128, 64, 128, 64, 64]
    assert [gather_stages(d, 2) for d in (64, 128, 256)] == [2, 2, 1]
    assert [row_threads(d, g) for d in (128, 256) for g in (4, 16)] == [8, None, 8, 8]


def test_split_blocks_maps_each_block_to_its_halves_and_keeps_empty_slots():
    sel = torch.tensor([[[[0, 3, -1], [2, -1, 1]]]], dtype=torch.int32)  # (1, 1, 2, 3)
    got = block_split.split_blocks(sel, 2, 64, keys=7 * 64 + 1)  # 8 blocks of 64: half 7 starts at 448 < 449
    assert got.dtype == torch.int32 and got.shape == (1, 1, 2, 6)
    assert got.tolist() == [[[[0, 1, 6, 7, -1, -1], [4, 5, -1, -1, 2, 3]]]]
    cut = block_split.split_blocks(sel, 2, 64, keys=7 * 64)  # half 7 would start at the last key: empty
    assert cut[0, 0, 0].tolist() == [0, 1, 6, -1, -1, -1]


def _inputs(B, S, Sk, H, Hk, Hp, K, seed):
    g = torch.Generator().manual_seed(seed)
    D, Dp = 256, 128

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q_proxy, k_proxy = rnd(B, S, Hp, Dp), rnd(B, Sk, Hp, Dp)
    q, k, v = rnd(B, S, H, D), rnd(B, Sk, Hk, D), rnd(B, Sk, Hk, D)
    nb = -(-Sk // 128)
    off = Sk - S
    rows = []
    for i in range(S):  # the query's own block, then distinct earlier ones, -1 past what exists
        own = (off + i) // 128
        earlier = torch.randperm(own, generator=g)[:K - 1].tolist() if own else []
        row = [own] + earlier
        rows.append(row + [-1] * (K - len(row)))
    sel = torch.tensor(rows, dtype=torch.int32).view(1, 1, S, K).expand(B, Hp, S, K).contiguous()
    assert int(sel.max()) < nb
    return q_proxy, k_proxy, q, k, v, sel


@pytest.mark.parametrize("S, Sk", [(300, 300), (200, 330), (129, 129)])
def test_reference_over_the_split_equals_the_reference_over_the_blocks(S, Sk):
    """Attention depends on the keys the blocks cover; the halves cover the same keys, so every output and gradient
    is the same in float64 (to rounding: the sums run in another order)."""
    qp, kp, q, k, v, sel = _inputs(2, S, Sk, 4, 2, 2, 3, seed=S + Sk)
    split, kbs = block_split.kernel_selection(sel, 128, 256, Sk)
    assert kbs == 64 and split.shape[-1] == 2 * sel.shape[-1]
    scale = 256 ** -0.5
    want = ref.msa_forward(qp, kp, q, k, v, sel, 128, scale)
    got = ref.msa_forward(qp, kp, q, k, v, split, 64, scale)
    for w, g_ in zip(want, got, strict=True):
        torch.testing.assert_close(g_, w, rtol=1e-12, atol=1e-12)
    out, lse, lse_p, _ = want
    go = torch.randn_like(out)
    klg = torch.full((), 0.37, dtype=torch.float64)
    gw = ref.msa_backward(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, go, klg)
    gg = ref.msa_backward(qp, kp, q, k, v, out, lse, lse_p, split, 64, scale, go, klg)
    for w, g_ in zip(gw, gg, strict=True):
        torch.testing.assert_close(g_, w, rtol=1e-12, atol=1e-12)


def test_the_plan_keeps_only_halves_with_a_causal_key():
    """The plan's live rule drops the second half of a query's own block while the query sits in its first half:
    the split plan has exactly one entry per (row, half) holding a causal key."""
    S = 300
    _, _, _, _, _, sel = _inputs(1, S, S, 4, 2, 1, 2, seed=3)
    split, kbs = block_split.kernel_selection(sel, 128, 256, S)
    plan = sparse_plan.sparse_plan(split, kbs, S, group=4, tile_queries=32, tiles_per_item=4)
    i = torch.arange(S).view(1, 1, S, 1)
    causal = ((split >= 0) & (split * 64 <= i)).sum().item()
    assert int(plan.items[:, 3].sum()) == causal < int((split >= 0).sum())


def test_the_split_is_kept_on_the_selection_for_the_eager_path_only():
    sel = torch.tensor([[[[1, 0]]]], dtype=torch.int32).expand(1, 1, 200, 2).contiguous()
    a, _ = block_split.kernel_selection(sel, 128, 256, 200)
    b, _ = block_split.kernel_selection(sel, 128, 256, 200)
    assert a is b  # the backward plans the forward's tensor (and takes its sorted lists)
    sel[0, 0, 0, 0] = 0  # an in-place write: a fresh split
    c, _ = block_split.kernel_selection(sel, 128, 256, 200)
    assert c is not a and c[0, 0, 0, :2].tolist() == [0, 1]
    other = sel.clone()
    with sparse_plan.ops_keep_no_lists():  # a custom op's body keeps nothing on its inputs
        block_split.kernel_selection(other, 128, 256, 200)
    assert not hasattr(other, block_split._KEPT_SPLIT)
    same, bs = block_split.kernel_selection(sel, 128, 128, 200)  # D 128 takes blocks of 128 as they are
    assert same is sel and bs == 128
