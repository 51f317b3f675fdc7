"""The selection kernel with keys longer than its queries: the queries are the last S of Sk key positions
(bottom-right causal alignment, the reference's), as a chunk of a sequence selects against its whole prefix
(separate key offsets, context parallelism).

Two checks per case: the chunk's selection equals, bit for bit, the rows [Sk - S, Sk) of the whole sequence's
selection (each score is the same dot product in the same MMA order, wherever the row sits in its tile), and it
satisfies the contract against float64 reference scores at each row's key position.
"""

import pytest
import torch

from tests.test_select_gpu import reference_selection

pytestmark = pytest.mark.gpu

CASES = [  # Sk, S (the chunk: the last S positions), K: offsets inside a block, at a block edge, past a tile
    (2301 + 129, 129, 16),
    (128 + 1, 1, 4),
    (384 + 100, 100, 16),
    (77 + 129, 129, 64),
    (4096 + 77, 4096, 8),
    (3000, 3000, 16),  # offset 0: the fixed-length case
]


def _inputs(Sk, dtype, seed, Hp=4, Hpk=2, Dp=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, Sk, Hp, Dp, device="cuda", generator=g).to(dtype)
    k = torch.randn(1, Sk, Hpk, Dp, device="cuda", generator=g).to(dtype)
    return q, k


def _check_rows_against_reference(sel, q_full, k, K, offset, scale):
    """Contract check of the chunk's rows at key positions offset + r, from float64 block scores of the whole
    sequence (layout, local block, the near-tie rule, exact set on nearly every row)."""
    from flash_msa_rt.reference import proxy_block_scores

    scores = proxy_block_scores(q_full.double(), k.double(), 128, scale).double()
    order, kept_scores, earlier = reference_selection(scores, K, 128)
    S = sel.shape[2]
    rows = slice(offset, offset + S)
    local = (torch.arange(offset, offset + S, device=sel.device) // 128).view(1, 1, S)
    n = torch.clamp(local, max=K - 1).unsqueeze(-1)
    slot = torch.arange(K, device=sel.device).view(1, 1, 1, K)
    assert torch.equal(sel.gather(-1, n.expand(*sel.shape[:3], 1)).squeeze(-1),
                       local.expand(*sel.shape[:3]).int()), "local block missing or misplaced"
    assert (sel[slot.expand_as(sel) > n] == -1).all(), "slots after the local block must be -1"
    kept = sel.masked_fill(slot >= n, -1).long()
    is_kept = slot < n
    Dp = q_full.shape[-1]
    mag = (q_full.double().abs().amax() * k.double().abs().amax() * Dp * scale).item()
    eps = 4 * Dp * 2.0**-24 * mag
    kth = kept_scores[:, :, rows, -1:]
    kth = torch.where(torch.isinf(kth), torch.full_like(kth, -1e300), kth)
    got = earlier[:, :, rows].gather(-1, kept.clamp(min=0))
    assert ((got >= kth - eps) | ~is_kept).all(), "a kept block scores below the reference threshold"
    ref_sets = torch.sort(order[:, :, rows].masked_fill(torch.isinf(kept_scores[:, :, rows]), -1), dim=-1).values
    got_sets = torch.sort(kept[..., : K - 1], dim=-1).values
    assert (ref_sets == got_sets).all(-1).double().mean().item() >= 0.99


@pytest.mark.parametrize("mma", ["sync", "wgmma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "Sk{}_S{}_K{}".format(*c))
def test_chunk_selects_as_its_rows_of_the_whole_sequence(case, dtype, mma, force_mma):
    from flash_msa_rt.ops.select import select_blocks_cuda

    force_mma(mma)
    Sk, S, K = case
    q_full, k = _inputs(Sk, dtype, seed=Sk + S)
    scale = 128 ** -0.5
    whole = select_blocks_cuda(q_full, k, K, 128, scale)
    chunk = select_blocks_cuda(q_full[:, Sk - S:], k, K, 128, scale)
    assert chunk.shape == (1, 4, S, K)
    assert torch.equal(chunk, whole[:, :, Sk - S:]), "the chunk's rows differ from the whole sequence's"
    _check_rows_against_reference(chunk, q_full, k, K, Sk - S, scale)


@pytest.mark.parametrize("schedule", ["block", "pairs"])
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "Sk{}_S{}_K{}".format(*c))
def test_fp8_chunk_selects_as_its_rows_of_the_whole_sequence(case, schedule, tuned):
    """fp8: k_proxy's block scales are the whole keys' (quantised once over Sk), so the chunk's rows are the
    whole sequence's, bit for bit, and agree with the reference's fp8 selection at their positions."""
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.reference.selection import select_blocks

    tuned(select={"schedule": schedule})
    Sk, S, K = case
    q_full, k = _inputs(Sk, torch.bfloat16, seed=Sk * 3 + S)
    whole = select_blocks_cuda(q_full, k, K, 128, 0.09, "fp8")
    chunk = select_blocks_cuda(q_full[:, Sk - S:], k, K, 128, 0.09, "fp8")
    assert torch.equal(chunk, whole[:, :, Sk - S:])
    ref = select_blocks(q_full[:, Sk - S:], k, K, 128, 0.09, "fp8")
    assert (chunk == ref).all(-1).double().mean().item() >= 0.99


def test_dp64_chunk():
    from flash_msa_rt.ops.select import select_blocks_cuda

    q_full, k = _inputs(2301 + 129, torch.bfloat16, seed=5, Hp=8, Hpk=1, Dp=64)
    whole = select_blocks_cuda(q_full, k, 16, 128, 0.125)
    assert torch.equal(select_blocks_cuda(q_full[:, 2301:], k, 16, 128, 0.125), whole[:, :, 2301:])
