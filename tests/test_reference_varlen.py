"""Varlen references against the oracle run on each sequence alone (causal within it, blocks from its start)."""

from __future__ import annotations

import pytest
import torch

import oracle
from flash_msa_rt.reference import (block_sparse_backward_varlen, block_sparse_forward_varlen, msa_backward_varlen,
                                    msa_forward_varlen, select_blocks_varlen, warmup_backward_varlen,
                                    warmup_forward_varlen)
from test_reference_msa import GRADS

# Unequal lengths with an empty sequence, a sequence shorter than a block and one that is an exact multiple.
CU = [0, 37, 37, 101, 117, 120]
H, Hk, Hp, Hpk, D, Dp, BS, K = 4, 2, 2, 1, 8, 8, 16, 3
SCALE = D ** -0.5


def packed(dtype, seed, cu=CU):
    total = cu[-1]
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q_proxy": oracle.randn(gen, (1, total, Hp, Dp), dtype),
        "k_proxy": oracle.randn(gen, (1, total, Hpk, Dp), dtype),
        "q": oracle.randn(gen, (1, total, H, D), dtype),
        "k": oracle.randn(gen, (1, total, Hk, D), dtype),
        "v": oracle.randn(gen, (1, total, Hk, D), dtype),
    }
    return x, oracle.randn(gen, (1, total, H, D), dtype), gen


def per_sequence(fn, cu=CU):
    """Concatenate fn(a, b) over the sequences; empty sequences are skipped."""
    return [fn(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def cat_s(parts, dim):
    return torch.cat(parts, dim=dim)


def test_select_blocks_varlen():
    x, _, _ = packed(torch.float64, 1)
    cu = torch.tensor(CU, dtype=torch.int32)
    got = select_blocks_varlen(x["q_proxy"], x["k_proxy"], cu, K, BS, SCALE)
    want = per_sequence(lambda a, b: oracle.select(x["q_proxy"][:, a:b], x["k_proxy"][:, a:b], K, BS, SCALE))
    assert got.dtype == torch.int32 and torch.equal(got.long(), cat_s(want, 2))


@pytest.mark.parametrize("kl_kind", ["scalar", "per_row"])
def test_msa_varlen(kl_kind):
    x, grad_out, gen = packed(torch.float64, 2)
    total = CU[-1]
    cu = torch.tensor(CU, dtype=torch.int64)
    idx = select_blocks_varlen(x["q_proxy"], x["k_proxy"], cu, K, BS, SCALE)
    if kl_kind == "scalar":  # kl_loss = sum of KL_p(i) / (Hp * total_tokens)
        kl_grad = oracle.randn(gen, (), torch.float64) / (Hp * total)
    else:
        kl_grad = oracle.randn(gen, (1, Hp, total), torch.float64)
    w = kl_grad.expand(1, Hp, total)
    fwd = msa_forward_varlen(*x.values(), idx, cu, BS, SCALE)
    grads = msa_backward_varlen(*x.values(), *fwd[:3], idx, BS, SCALE, grad_out, cu, kl_grad)
    want = per_sequence(lambda a, b: oracle.msa(*(t[:, a:b] for t in x.values()), K, BS, SCALE, grad_out[:, a:b],
                                                w[:, :, a:b], block_indices=idx[:, :, a:b]))
    _compare(fwd, grads, want)


def test_warmup_varlen():
    x, grad_out, gen = packed(torch.float64, 3)
    cu = torch.tensor(CU, dtype=torch.int32)
    kl_grad = oracle.randn(gen, (1, Hp, CU[-1]), torch.float64)
    fwd = warmup_forward_varlen(*x.values(), cu, SCALE)
    grads = warmup_backward_varlen(*x.values(), *fwd[:3], SCALE, grad_out, cu, kl_grad)
    want = per_sequence(lambda a, b: oracle.warmup(*(t[:, a:b] for t in x.values()), SCALE, grad_out[:, a:b],
                                                   kl_grad[:, :, a:b]))
    _compare(fwd, grads, want)


def test_block_sparse_varlen():
    x, grad_out, gen = packed(torch.float64, 4)
    cu = torch.tensor(CU, dtype=torch.int32)
    idx = torch.full((1, Hk, CU[-1], 4), -1, dtype=torch.int32)
    for a, b in zip(CU, CU[1:]):  # indices relative to each sequence, duplicates and empty slots included
        idx[:, :, a:b] = torch.randint(-1, -(-(b - a) // BS), (1, Hk, b - a, 4), generator=gen, dtype=torch.int32)
    q, k, v = x["q"], x["k"], x["v"]
    out, lse = block_sparse_forward_varlen(q, k, v, idx, cu, BS, SCALE)
    dq, dk, dv = block_sparse_backward_varlen(q, k, v, out, lse, idx, BS, SCALE, grad_out, cu)
    want = per_sequence(lambda a, b: oracle.block_sparse(q[:, a:b], k[:, a:b], v[:, a:b], idx[:, :, a:b], BS, SCALE,
                                                         grad_out[:, a:b]))
    oracle.check("out", out, cat_s([r.out for r in want], 1), torch.float64)
    oracle.check("lse", lse, cat_s([r.lse for r in want], 2), torch.float64)
    for n, g in (("q", dq), ("k", dk), ("v", dv)):
        oracle.check(f"d{n}", g, cat_s([r.grads[n] for r in want], 1), torch.float64)


def test_only_empty_sequences():
    x, grad_out, _ = packed(torch.float32, 5, cu=[0, 0, 0])
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    assert select_blocks_varlen(x["q_proxy"], x["k_proxy"], cu, K, BS, SCALE).shape == (1, Hp, 0, K)
    fwd = msa_forward_varlen(*x.values(), torch.zeros(1, Hp, 0, K, dtype=torch.int32), cu, BS, SCALE)
    assert [t.shape for t in fwd] == [(1, 0, H, D), (1, H, 0), (1, Hp, 0), (1, Hp, 0)]
    grads = warmup_backward_varlen(*x.values(), *fwd[:3], SCALE, grad_out, cu, torch.ones(()))
    assert [g.shape for g in grads] == [t.shape for t in x.values()]


def test_bad_cu_seqlens():
    x, _, _ = packed(torch.float32, 6)
    for cu, what in (([0, 50, 40, 120], "never decrease"), ([1, 120], "start at 0"), ([0, 119], "end at")):
        with pytest.raises(ValueError, match=what):
            select_blocks_varlen(x["q_proxy"], x["k_proxy"], torch.tensor(cu, dtype=torch.int32), K, BS, SCALE)
    with pytest.raises(ValueError, match="int32/int64"):
        select_blocks_varlen(x["q_proxy"], x["k_proxy"], torch.tensor([0.0, 120.0]), K, BS, SCALE)
    with pytest.raises(ValueError, match="B == 1"):
        q2 = {n: t.expand(2, -1, -1, -1) for n, t in x.items()}
        warmup_forward_varlen(*q2.values(), torch.tensor(CU, dtype=torch.int32), SCALE)


def _compare(fwd, grads, want):
    out, lse, lse_proxy, kl_rows = fwd
    oracle.check("out", out, cat_s([r.out for r in want], 1), torch.float64)
    for name, got in (("lse", lse), ("lse_proxy", lse_proxy), ("kl_rows", kl_rows)):
        oracle.check(name, got, cat_s([getattr(r, name) for r in want], 2), torch.float64)
    for n, g in zip(GRADS, grads):
        oracle.check(f"d{n}", g, cat_s([r.grads[n] for r in want], 1), torch.float64)
