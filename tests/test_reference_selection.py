"""Reference select_blocks against the oracle's stable sort, and the contract's selection rules."""

from __future__ import annotations

import pytest
import torch

import oracle
from flash_msa_rt.reference import attention, proxy_block_scores, select_blocks

# (B, S, Hp, Hpk, Dp, block_size, K)
SHAPES = {
    "oddS_Hpk2": (1, 77, 4, 2, 16, 16, 3),
    "multiple_B2": (2, 64, 2, 1, 8, 16, 2),
    "S<block_K>blocks": (1, 10, 2, 2, 8, 16, 3),
    "bs128_partial": (1, 300, 2, 1, 8, 128, 2),
    "K1_bs8": (1, 100, 3, 1, 8, 8, 1),
    "K>blocks_bs4": (1, 50, 1, 1, 4, 4, 20),
    "many_blocks": (1, 129, 2, 1, 8, 4, 9),
}


def proxies(shape, dtype, seed):
    B, S, Hp, Hpk, Dp, Bs, K = shape
    gen = torch.Generator().manual_seed(seed)
    return oracle.randn(gen, (B, S, Hp, Dp), dtype), oracle.randn(gen, (B, S, Hpk, Dp), dtype), Bs, K, Dp ** -0.5


@pytest.mark.parametrize("name", SHAPES)
def test_float64_equals_oracle(name):
    qp, kp, Bs, K, scale = proxies(SHAPES[name], torch.float64, list(SHAPES).index(name))
    got = select_blocks(qp, kp, K, Bs, scale)
    assert got.dtype == torch.int32 and got.shape == (*qp.shape[:1], qp.shape[2], qp.shape[1], K)
    assert torch.equal(got.long(), oracle.select(qp, kp, K, Bs, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["oddS_Hpk2", "many_blocks"])
def test_low_precision_selects_near_best_blocks(name, dtype):
    """The contract's near-tie rule: every selected earlier block scores >= the float64 K-1-th best - eps."""
    qp, kp, Bs, K, scale = proxies(SHAPES[name], dtype, 20 + list(SHAPES).index(name))
    got = select_blocks(qp, kp, K, Bs, scale).long()
    want = oracle.select(qp.double(), kp.double(), K, Bs, scale)
    c = proxy_block_scores(qp.double(), kp.double(), Bs, scale).double()  # (B, Hp, S, NB), exact enough
    S = qp.shape[1]
    local = (torch.arange(S) // Bs).view(1, 1, S, 1)
    # float32 scores of Dp-term dot products: rounding ~ Dp * 2**-24 * |q||k| scale; bf16 inputs are exact in fp32.
    eps = 1e-5
    earlier = want.clamp(min=0) < local
    worst_wanted = torch.where((want >= 0) & earlier, c.gather(-1, want.clamp(min=0)), torch.inf).amin(-1)
    picked = (got >= 0) & (got < local)
    got_scores = torch.where(picked, c.gather(-1, got.clamp(min=0)), torch.inf).amin(-1)
    assert bool((got_scores >= worst_wanted - eps).all())
    assert bool(((got == local).any(-1)).all())
    agree = (got == want).all(-1).double().mean().item()
    assert agree >= 0.99, f"only {agree:.3f} of the rows select exactly the float64 set"


def test_ties_go_to_the_smaller_block():
    """Integer-valued inputs make exact ties: identical blocks, and pairs of equal blocks among distinct ones."""
    Bs, K, S, Dp = 8, 4, 70, 4
    gen = torch.Generator().manual_seed(30)
    qp = torch.randint(-3, 4, (1, S, 2, Dp), generator=gen).double()
    block = torch.randint(-3, 4, (Bs, 1, Dp), generator=gen).double()
    kp = block.repeat(-(-S // Bs), 1, 1)[:S].unsqueeze(0)  # every block holds the same keys
    for dt in (torch.float64, torch.float32):
        got = select_blocks(qp.to(dt), kp.to(dt), K, Bs, 0.5)
        for i in range(S):
            L = i // Bs
            # In a full earlier block every query sees the same keys, so all earlier blocks tie: 0, 1, 2 win.
            expect = sorted({L, *range(min(K - 1, L))}) + [-1] * (K - min(K, L + 1))
            assert got[0, :, i].tolist() == [expect, expect], (dt, i)
    # Distinct random blocks with blocks 5 and 2 copied into 6 and 3: the copies never beat their originals.
    kp = torch.randint(-3, 4, (1, S, 1, Dp), generator=gen).double()
    kp[:, 6 * Bs:7 * Bs] = kp[:, 5 * Bs:6 * Bs]
    kp[:, 3 * Bs:4 * Bs] = kp[:, 2 * Bs:3 * Bs]
    got = select_blocks(qp, kp, K, Bs, 0.5)
    assert torch.equal(got.long(), oracle.select(qp, kp, K, Bs, 0.5))
    rows = got[0, :, 7 * Bs:]  # rows that see blocks 0..6 in full
    assert not ((rows == 6).any(-1) & ~(rows == 5).any(-1)).any()
    assert not ((rows == 3).any(-1) & ~(rows == 2).any(-1)).any()


def test_slot_layout_local_block_and_counts():
    """Ascending, -1 last, the local block always present, min(K, blk(i) + 1) distinct blocks, none after blk(i)."""
    qp, kp, Bs, K, scale = proxies(SHAPES["many_blocks"], torch.float32, 40)
    got = select_blocks(qp, kp, K, Bs, scale).long()
    S = qp.shape[1]
    local = (torch.arange(S) // Bs).view(1, 1, S)
    filled = got >= 0
    assert bool((got == local.unsqueeze(-1)).any(-1).all())
    assert torch.equal(filled.sum(-1), torch.clamp(local + 1, max=K).expand_as(filled.sum(-1)))
    assert bool((filled[..., 1:] <= filled[..., :-1]).all())  # -1 only after the filled slots
    assert bool(((got[..., 1:] > got[..., :-1]) | ~filled[..., 1:]).all())  # strictly ascending: distinct
    assert bool((got <= local.unsqueeze(-1)).all())


def test_chunked_selection_is_unchanged():
    qp, kp, Bs, K, scale = proxies(SHAPES["oddS_Hpk2"], torch.float64, 50)
    whole = select_blocks(qp, kp, K, Bs, scale)
    B, S, Hp = qp.shape[:3]
    with attention.chunked_by(B * Hp * S * 3):  # 3 rows per chunk
        assert len(list(attention.row_chunks(S, B * Hp * S))) == -(-S // 3)
        assert torch.equal(select_blocks(qp, kp, K, Bs, scale), whole)


def test_validation():
    qp, kp, Bs, K, scale = proxies(SHAPES["K1_bs8"], torch.float32, 60)
    with pytest.raises(ValueError, match="top_k_blocks"):
        select_blocks(qp, kp, 0, Bs, scale)
    with pytest.raises(ValueError, match="block_size"):
        select_blocks(qp, kp, K, 0, scale)
    with pytest.raises(ValueError, match="scale"):
        select_blocks(qp, kp, K, Bs, -1.0)
    with pytest.raises(ValueError, match="Hpk"):
        select_blocks(qp, kp.expand(-1, -1, 2, -1), K, Bs, scale)  # Hp = 3 is not a multiple of 2
    with pytest.raises(TypeError, match="q_proxy"):
        select_blocks(qp.numpy(), kp, K, Bs, scale)
