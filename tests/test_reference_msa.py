"""Reference MSA forward / backward against the dense float64 oracle (tests/oracle.py)."""

from __future__ import annotations

import pytest
import torch

import oracle
from flash_msa_rt.reference import attention, msa_backward, msa_forward, select_blocks

GRADS = ("q_proxy", "k_proxy", "q", "k", "v")

# (B, S, H, Hk, Hp, Hpk, D, Dp, block_size, K): odd S / partial last block, exact multiples, S < block_size;
# G = H / Hp in {1, 2, 4, 8, 16}; Hp > Hk, Hp = Hk, Hp < Hk; Hpk > 1; K = 1, mid, > number of blocks.
SHAPES = {
    "G1_Hp>Hk_Hpk2_oddS": (1, 77, 4, 2, 4, 2, 16, 8, 16, 3),
    "G2_Hp<Hk_multiple": (2, 64, 4, 4, 2, 1, 16, 8, 16, 2),
    "G4_Hp=Hk_Hpk2": (1, 45, 8, 2, 2, 2, 8, 8, 16, 2),
    "G8_K>blocks": (1, 37, 8, 1, 1, 1, 8, 4, 8, 7),
    "G16_Hp<Hk_bs4": (1, 33, 16, 4, 1, 1, 8, 8, 4, 3),
    "S<block_size": (1, 10, 4, 2, 2, 1, 8, 8, 16, 2),
    "bs128_partial": (1, 300, 2, 1, 1, 1, 16, 8, 128, 2),
    "K1": (1, 50, 2, 1, 2, 1, 8, 8, 16, 1),
}


def make_case(shape, dtype, seed):
    B, S, H, Hk, Hp, Hpk, D, Dp, Bs, K = shape
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q_proxy": oracle.randn(gen, (B, S, Hp, Dp), dtype),
        "k_proxy": oracle.randn(gen, (B, S, Hpk, Dp), dtype),
        "q": oracle.randn(gen, (B, S, H, D), dtype),
        "k": oracle.randn(gen, (B, S, Hk, D), dtype),
        "v": oracle.randn(gen, (B, S, Hk, D), dtype),
    }
    grad_out = oracle.randn(gen, (B, S, H, D), dtype)
    kl_up = oracle.randn(gen, (), torch.float32)  # upstream grad of kl_loss (a loss coefficient)
    return x, grad_out, kl_up, Bs, K, D ** -0.5


def mean_kl_grad(kl_up, x):
    """The kl_grad the API passes for kl_loss = mean KL: upstream / (B * Hp * S), fp32 (fp64 for fp64 inputs)."""
    B, S, Hp = x["q_proxy"].shape[:3]
    dt = torch.float64 if x["q"].dtype == torch.float64 else torch.float32
    return (kl_up.double() / (B * Hp * S)).to(dt)


def run_reference(x, idx, Bs, scale, grad_out, kl_grad):
    fwd = msa_forward(*x.values(), idx, Bs, scale)
    grads = msa_backward(*x.values(), *fwd[:3], idx, Bs, scale, grad_out, kl_grad)
    return fwd, dict(zip(GRADS, grads))


def run_oracle(x, idx, Bs, K, scale, grad_out, kl_up, dtype):
    args = [t.to(dtype) for t in x.values()]
    up = None if kl_up is None else kl_up.to(dtype)
    return oracle.msa(*args, K, Bs, scale, None if grad_out is None else grad_out.to(dtype), up, block_indices=idx)


def compare(fwd, grads, want, base, dtype):
    out, lse, lse_proxy, kl_rows = fwd
    b = (lambda f: None) if base is None else (lambda f: getattr(base, f))
    oracle.check("out", out, want.out, dtype, b("out"))
    # lse / KL are float32 results whatever the input dtype: only the float32 error applies.
    oracle.check("lse", lse, want.lse, dtype, b("lse"), rounds_to_dtype=False)
    oracle.check("lse_proxy", lse_proxy, want.lse_proxy, dtype, b("lse_proxy"), rounds_to_dtype=False)
    oracle.check("kl_rows", kl_rows, want.kl_rows, dtype, b("kl_rows"), rounds_to_dtype=False)
    # A bf16 gradient costs its own rounding plus that of delta = rowsum(dO * O) read from the bf16 out
    # (measured up to ~2.2x the rounding alone): factor 4.
    for n in GRADS:
        oracle.check(f"d{n}", grads[n], want.grads[n], dtype, None if base is None else base.grads[n], factor=4.0)


@pytest.mark.parametrize("name", SHAPES)
def test_float64_matches_oracle(name):
    x, grad_out, kl_up, Bs, K, scale = make_case(SHAPES[name], torch.float64, seed=list(SHAPES).index(name))
    idx = select_blocks(x["q_proxy"], x["k_proxy"], K, Bs, scale)
    want = oracle.msa(*x.values(), K, Bs, scale, grad_out, kl_up.double())
    assert torch.equal(idx.long(), want.block_indices)
    fwd, grads = run_reference(x, idx, Bs, scale, grad_out, mean_kl_grad(kl_up, x))
    assert fwd[0].dtype == torch.float64 and fwd[1].dtype == torch.float64
    compare(fwd, grads, want, None, torch.float64)
    assert torch.allclose(fwd[3].mean(), want.kl_loss, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["G1_Hp>Hk_Hpk2_oddS", "G4_Hp=Hk_Hpk2", "bs128_partial"])
def test_low_precision_within_dtype_error(name, dtype):
    """fp32 / bf16 inputs: error within a small multiple of what the dtype costs the float64 oracle."""
    x, grad_out, kl_up, Bs, K, scale = make_case(SHAPES[name], dtype, seed=100 + list(SHAPES).index(name))
    idx = oracle.select(*(x[n].double() for n in ("q_proxy", "k_proxy")), K, Bs, scale)
    want = run_oracle(x, idx, Bs, K, scale, grad_out, kl_up, torch.float64)
    base = run_oracle(x, idx, Bs, K, scale, grad_out, kl_up, torch.float32)
    fwd, grads = run_reference(x, idx.to(torch.int32), Bs, scale, grad_out, mean_kl_grad(kl_up, x))
    assert fwd[0].dtype == dtype and fwd[1].dtype == torch.float32 and fwd[3].dtype == torch.float32
    assert all(grads[n].dtype == dtype for n in GRADS)
    compare(fwd, grads, want, base, dtype)


def test_kl_grad_none_and_grad_out_none():
    x, grad_out, kl_up, Bs, K, scale = make_case(SHAPES["G2_Hp<Hk_multiple"], torch.float64, seed=11)
    idx = select_blocks(x["q_proxy"], x["k_proxy"], K, Bs, scale)
    # kl_grad None: no proxy gradient; main gradients unchanged.
    fwd, grads = run_reference(x, idx, Bs, scale, grad_out, None)
    want = oracle.msa(*x.values(), K, Bs, scale, grad_out, None, block_indices=idx)
    compare(fwd, grads, want, None, torch.float64)
    assert not grads["q_proxy"].any() and not grads["k_proxy"].any()
    # grad_out None: main gradients zero, the proxy still trains.
    fwd, grads = run_reference(x, idx, Bs, scale, None, mean_kl_grad(kl_up, x))
    want = oracle.msa(*x.values(), K, Bs, scale, None, kl_up.double(), block_indices=idx)
    compare(fwd, grads, want, None, torch.float64)
    assert not grads["q"].any() and not grads["k"].any() and not grads["v"].any()
    assert grads["q_proxy"].abs().max() > 0


def test_non_scalar_kl_grad():
    """kl_grad (B, Hp, S) and (1, Hp, 1): per-row upstream gradients of KL_p(i)."""
    x, grad_out, _, Bs, K, scale = make_case(SHAPES["G1_Hp>Hk_Hpk2_oddS"], torch.float64, seed=12)
    B, S, Hp = x["q_proxy"].shape[:3]
    idx = select_blocks(x["q_proxy"], x["k_proxy"], K, Bs, scale)
    gen = torch.Generator().manual_seed(3)
    for shape in ((B, Hp, S), (1, Hp, 1)):
        w = torch.randn(shape, generator=gen, dtype=torch.float64)
        fwd, grads = run_reference(x, idx, Bs, scale, grad_out, w)
        want = oracle.msa(*x.values(), K, Bs, scale, grad_out, w.expand(B, Hp, S), block_indices=idx)
        compare(fwd, grads, want, None, torch.float64)


def test_arbitrary_block_indices_with_duplicates_and_empty_slots():
    """msa_* accept any indices (the kernel's own selection): duplicates count once, -1 slots are empty."""
    x, grad_out, kl_up, Bs, K, scale = make_case(SHAPES["G4_Hp=Hk_Hpk2"], torch.float64, seed=13)
    B, S, Hp = x["q_proxy"].shape[:3]
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(-1, -(-S // Bs), (B, Hp, S, 4), generator=gen, dtype=torch.int32)
    idx[..., 0] = (torch.arange(S) // Bs).to(torch.int32)  # keep the local block: every row has a key
    idx[..., 1] = idx[..., 0]  # a duplicate
    fwd, grads = run_reference(x, idx, Bs, scale, grad_out, mean_kl_grad(kl_up, x))
    want = oracle.msa(*x.values(), K, Bs, scale, grad_out, kl_up.double(), block_indices=idx)
    compare(fwd, grads, want, None, torch.float64)


def test_chunked_rows_never_score_s_by_s(monkeypatch):
    """A small chunk budget splits the rows into many chunks, none scoring S x S, with unchanged results."""
    x, grad_out, kl_up, Bs, K, scale = make_case(SHAPES["G1_Hp>Hk_Hpk2_oddS"], torch.float64, seed=14)
    B, S, H = x["q"].shape[:3]
    idx = select_blocks(x["q_proxy"], x["k_proxy"], K, Bs, scale)
    whole = run_reference(x, idx, Bs, scale, grad_out, mean_kl_grad(kl_up, x))

    chunks = []
    real = attention.row_chunks

    def recording(S_, elems_per_row):
        for i0, i1 in real(S_, elems_per_row):
            chunks.append((i0, i1, elems_per_row))
            yield i0, i1

    monkeypatch.setattr(attention, "row_chunks", recording)
    with attention.chunked_by(B * H * S * 5):  # 5 rows per chunk
        small = run_reference(x, idx, Bs, scale, grad_out, mean_kl_grad(kl_up, x))
    assert len(chunks) >= 2 * -(-S // 5)  # forward and backward both chunked
    assert max(i1 - i0 for i0, i1, _ in chunks) == 5
    for a, b in zip(whole[0], small[0]):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    for n in GRADS:
        torch.testing.assert_close(whole[1][n], small[1][n], rtol=1e-12, atol=1e-13)


def test_validation_names_the_argument():
    x, grad_out, _, Bs, K, scale = make_case(SHAPES["K1"], torch.float64, seed=15)
    idx = select_blocks(x["q_proxy"], x["k_proxy"], K, Bs, scale)
    bad = idx.clone()
    bad[0, 0, 3, 0] = 4  # S = 50, block 16: blocks 0..3
    with pytest.raises(ValueError, match=r"block_indices\[0, 0, 3, 0\] = 4"):
        msa_forward(*x.values(), bad, Bs, scale)
    with pytest.raises(ValueError, match="heads"):
        msa_forward(*x.values(), idx[:, :1], Bs, scale)
    with pytest.raises(ValueError, match="block_size"):
        msa_forward(*x.values(), idx, 0, scale)
    with pytest.raises(ValueError, match="kl_grad"):
        fwd = msa_forward(*x.values(), idx, Bs, scale)
        msa_backward(*x.values(), *fwd[:3], idx, Bs, scale, grad_out, torch.ones(3))
