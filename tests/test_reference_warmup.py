"""Reference warmup mode (dense causal main attention, KL over the full causal set) against the oracle."""

from __future__ import annotations

import pytest
import torch

import oracle
from flash_msa_rt.reference import warmup_backward, warmup_forward
from test_reference_msa import GRADS, SHAPES, compare, make_case, mean_kl_grad


def run_reference(x, scale, grad_out, kl_grad):
    fwd = warmup_forward(*x.values(), scale)
    grads = warmup_backward(*x.values(), *fwd[:3], scale, grad_out, kl_grad)
    return fwd, dict(zip(GRADS, grads))


@pytest.mark.parametrize("name", ["G1_Hp>Hk_Hpk2_oddS", "G2_Hp<Hk_multiple", "G8_K>blocks", "G16_Hp<Hk_bs4",
                                  "S<block_size"])
def test_float64_matches_oracle(name):
    x, grad_out, kl_up, _, _, scale = make_case(SHAPES[name], torch.float64, seed=200 + list(SHAPES).index(name))
    fwd, grads = run_reference(x, scale, grad_out, mean_kl_grad(kl_up, x))
    want = oracle.warmup(*x.values(), scale, grad_out, kl_up.double())
    compare(fwd, grads, want, None, torch.float64)
    assert torch.allclose(fwd[3].mean(), want.kl_loss, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_dtype_error(dtype):
    x, grad_out, kl_up, _, _, scale = make_case(SHAPES["G4_Hp=Hk_Hpk2"], dtype, seed=210)
    fwd, grads = run_reference(x, scale, grad_out, mean_kl_grad(kl_up, x))
    want = oracle.warmup(*(t.double() for t in x.values()), scale, grad_out.double(), kl_up.double())
    base = oracle.warmup(*(t.float() for t in x.values()), scale, grad_out.float(), kl_up.float())
    compare(fwd, grads, want, base, dtype)


def test_equals_msa_when_every_block_is_selected():
    """Warmup is MSA with K >= number of blocks: same outputs and gradients (a cross-check of both paths)."""
    from flash_msa_rt.reference import msa_backward, msa_forward, select_blocks

    x, grad_out, _, Bs, _, scale = make_case(SHAPES["G1_Hp>Hk_Hpk2_oddS"], torch.float64, seed=220)
    S = x["q"].shape[1]
    idx = select_blocks(x["q_proxy"], x["k_proxy"], -(-S // Bs), Bs, scale)
    w = oracle.randn(torch.Generator().manual_seed(221), (1, x["q_proxy"].shape[2], S), torch.float64)
    got = warmup_forward(*x.values(), scale)
    ref = msa_forward(*x.values(), idx, Bs, scale)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    ga = warmup_backward(*x.values(), *got[:3], scale, grad_out, w)
    gb = msa_backward(*x.values(), *ref[:3], idx, Bs, scale, grad_out, w)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_kl_grad_none_and_grad_out_none():
    x, _, kl_up, _, _, scale = make_case(SHAPES["G2_Hp<Hk_multiple"], torch.float64, seed=230)
    fwd, grads = run_reference(x, scale, None, None)
    assert not any(g.any() for g in grads.values())
    fwd, grads = run_reference(x, scale, None, mean_kl_grad(kl_up, x))
    want = oracle.warmup(*x.values(), scale, None, kl_up.double())
    compare(fwd, grads, want, None, torch.float64)
