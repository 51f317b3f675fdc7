"""Reference block-sparse attention against the dense oracle: duplicates, empty slots, rows with no key, errors."""

from __future__ import annotations

import pytest
import torch

import oracle
from flash_msa_rt.reference import block_sparse_backward, block_sparse_forward

# (B, S, H, Hk, Hi, D, block_size, K)
SHAPES = {
    "Hi=Hk_oddS": (1, 77, 4, 2, 2, 16, 16, 4),
    "Hi=1_multiple_B2": (2, 64, 4, 1, 1, 8, 16, 3),
    "Hi=H_bs4": (1, 33, 4, 2, 4, 8, 4, 5),
    "S<block": (1, 9, 2, 1, 2, 8, 16, 2),
    "bs128_partial_Hi>Hk": (1, 260, 4, 1, 2, 16, 128, 2),
}


def make_case(shape, dtype, seed, *, empty_rows=True):
    B, S, H, Hk, Hi, D, Bs, K = shape
    gen = torch.Generator().manual_seed(seed)
    q = oracle.randn(gen, (B, S, H, D), dtype)
    k = oracle.randn(gen, (B, S, Hk, D), dtype)
    v = oracle.randn(gen, (B, S, Hk, D), dtype)
    grad_out = oracle.randn(gen, (B, S, H, D), dtype)
    nb = -(-S // Bs)
    idx = torch.randint(-1, nb, (B, Hi, S, K), generator=gen, dtype=torch.int32)
    if K > 1:
        idx[..., 1] = idx[..., 0]  # duplicates count once
    if empty_rows:
        idx[:, 0, ::5] = -1  # rows with every slot empty
        idx[:, -1, 1::7, :] = nb - 1  # only the last block: empty for rows before it (causality)
    return q, k, v, grad_out, idx, Bs, D ** -0.5


def run_reference(q, k, v, idx, Bs, scale, grad_out):
    out, lse = block_sparse_forward(q, k, v, idx, Bs, scale)
    return out, lse, block_sparse_backward(q, k, v, out, lse, idx, Bs, scale, grad_out)


def compare(got, want, base, dtype):
    out, lse, (dq, dk, dv) = got
    b = (lambda n: None) if base is None else (lambda n: getattr(base, n))
    oracle.check("out", out, want.out, dtype, b("out"))
    oracle.check("lse", lse, want.lse, dtype, b("lse"), rounds_to_dtype=False)
    # bf16 gradients: their rounding plus delta read from the bf16 out (see test_reference_msa): factor 4.
    for n, g in (("q", dq), ("k", dk), ("v", dv)):
        oracle.check(f"d{n}", g, want.grads[n], dtype, None if base is None else base.grads[n], factor=4.0)


@pytest.mark.parametrize("name", SHAPES)
def test_float64_matches_oracle(name):
    q, k, v, grad_out, idx, Bs, scale = make_case(SHAPES[name], torch.float64, list(SHAPES).index(name))
    got = run_reference(q, k, v, idx, Bs, scale, grad_out)
    want = oracle.block_sparse(q, k, v, idx, Bs, scale, grad_out)
    compare(got, want, None, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_dtype_error(dtype):
    q, k, v, grad_out, idx, Bs, scale = make_case(SHAPES["Hi=Hk_oddS"], dtype, 10)
    got = run_reference(q, k, v, idx, Bs, scale, grad_out)
    want = oracle.block_sparse(q.double(), k.double(), v.double(), idx, Bs, scale, grad_out.double())
    base = oracle.block_sparse(q.float(), k.float(), v.float(), idx, Bs, scale, grad_out.float())
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    compare(got, want, base, dtype)


def test_rows_without_keys_give_zero_and_minus_inf():
    _, S, H, _, Hi, _, _, _ = SHAPES["Hi=Hk_oddS"]
    q, k, v, grad_out, idx, Bs, scale = make_case(SHAPES["Hi=Hk_oddS"], torch.float32, 11, empty_rows=False)
    idx[:, :, 3::4] = -1  # a quarter of the rows (every index head) see nothing
    out, lse, (dq, dk, dv) = run_reference(q, k, v, idx, Bs, scale, grad_out)
    assert not out[:, 3::4].any() and bool(torch.isneginf(lse[:, :, 3::4]).all())
    assert not dq[:, 3::4].any()
    # A row has a key iff it lists a block <= its own (later blocks are causally invisible).
    blk = (torch.arange(S) // Bs).view(1, 1, S, 1)
    has_key = ((idx >= 0) & (idx <= blk)).any(-1).repeat_interleave(H // Hi, dim=1)
    assert torch.equal(torch.isfinite(lse), has_key) and not has_key.all()
    # Without those rows' upstream gradient nothing changes: they contribute nothing to dk, dv.
    g2 = grad_out.clone()
    g2[:, 3::4] = 0
    _, _, (_, dk2, dv2) = run_reference(q, k, v, idx, Bs, scale, g2)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)
    all_empty = torch.full_like(idx, -1)
    out, lse, grads = run_reference(q, k, v, all_empty, Bs, scale, grad_out)
    assert not out.any() and bool(torch.isneginf(lse).all()) and not any(g.any() for g in grads)


def test_grad_out_none_gives_zero_gradients():
    q, k, v, _, idx, Bs, scale = make_case(SHAPES["Hi=1_multiple_B2"], torch.float32, 12)
    out, lse = block_sparse_forward(q, k, v, idx, Bs, scale)
    grads = block_sparse_backward(q, k, v, out, lse, idx, Bs, scale, None)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and not any(g.any() for g in grads)


@pytest.mark.parametrize("bad", [-2, 5, 100])
def test_out_of_range_index_is_an_error(bad):
    q, k, v, _, idx, Bs, scale = make_case(SHAPES["S<block"], torch.float32, 13)  # 1 block: [-1, 1) allowed
    idx = idx.clone()
    idx[0, 1, 4, 1] = bad
    with pytest.raises(ValueError, match=rf"block_indices\[0, 1, 4, 1\] = {bad} is outside \[-1, 1\)"):
        block_sparse_forward(q, k, v, idx, Bs, scale)


def test_shape_errors_name_the_argument():
    q, k, v, _, idx, Bs, scale = make_case(SHAPES["Hi=H_bs4"], torch.float32, 14)
    with pytest.raises(ValueError, match="Hi = 3"):
        block_sparse_forward(q, k, v, idx[:, :3], Bs, scale)  # H = 4 is not a multiple of 3
    with pytest.raises(TypeError, match="block_indices"):
        block_sparse_forward(q, k, v, idx.float(), Bs, scale)
    with pytest.raises(ValueError, match="k .* and v"):
        block_sparse_forward(q, k, v[:, :-1], idx, Bs, scale)
    with pytest.raises(ValueError, match="lse"):
        out, lse = block_sparse_forward(q, k, v, idx, Bs, scale)
        block_sparse_backward(q, k, v, out, lse[:, :1], idx, Bs, scale, None)
