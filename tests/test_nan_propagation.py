"""NaN propagation on the reference path (msa-semantics.md, "Non-finite inputs"): a NaN in any of the five inputs,
in one query row or one key, shows as NaN in exactly the results that depend on it: out rows (and their elements),
lse, lse_proxy, KL rows and kl_loss, and every gradient; everything else keeps its clean value, and rows with no
allowed key stay 0.

Where NaN must appear comes from the dense float64 oracle (tests/oracle.py), by dependence: a result depends on an
input element when changing that element (by +1, finite) changes it. The oracle multiplies masked keys by an exact 0,
so the set it reports is the contract's, not an artefact of 0 * NaN.
"""

import pytest
import torch

from tests import oracle
from tests.nan_cases import CASES, MSA_RESULTS, dependents, perturbed, poisoned

B, S, H, Hk, Hp, Hpk, D, BS, K = 1, 40, 4, 2, 2, 1, 8, 8, 2
SCALE = D ** -0.5


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proxy": (B, S, Hp, D), "k_proxy": (B, S, Hpk, D), "q": (B, S, H, D), "k": (B, S, Hk, D),
              "v": (B, S, Hk, D)}
    x = {n: oracle.randn(g, s, torch.float64) for n, s in shapes.items()}
    dout = oracle.randn(g, (B, S, H, D), torch.float64)
    kl_up = torch.rand(B, Hp, S, generator=g, dtype=torch.float64) + 0.5
    return x, dout, kl_up


def _oracle_msa(x, dout, kl_up, sel):
    r = oracle.msa(*x.values(), K, BS, SCALE, grad_out=dout, kl_upstream=kl_up, block_indices=sel)
    return {"out": r.out, "lse": r.lse, "lse_proxy": r.lse_proxy, "kl_rows": r.kl_rows,
            **{f"d{n}": r.grads[n] for n in x}}


def _reference_msa(x, dout, kl_up, sel):
    from flash_msa_rt import reference

    ins = list(x.values())
    out, lse, lse_p, kl_rows = reference.msa_forward(*ins, sel, BS, SCALE)
    grads = reference.msa_backward(*ins, out, lse, lse_p, sel, BS, SCALE, dout, kl_up)
    return {"out": out, "lse": lse, "lse_proxy": lse_p, "kl_rows": kl_rows, **{f"d{n}": g for n, g in zip(x, grads)}}


def _assert_nan_exactly(got: dict, clean: dict, expected: dict, what: str):
    for name in MSA_RESULTS:
        if name not in got:
            continue
        nan = torch.isnan(got[name])
        want = expected[name]
        extra, missing = int((nan & ~want).sum()), int((want & ~nan).sum())
        assert extra == 0 and missing == 0, f"{what}: {name}: {missing} NaN missing, {extra} unexpected"
        fin = ~want
        torch.testing.assert_close(got[name][fin], clean[name][fin], rtol=0, atol=0,
                                   msg=f"{what}: {name} changed where it does not depend on the NaN")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_msa_reference_nan_reaches_exactly_its_dependents(case):
    x, dout, kl_up = _inputs()
    sel = oracle.select(x["q_proxy"], x["k_proxy"], K, BS, SCALE)  # fixed: selection under NaN is unspecified
    clean_oracle = _oracle_msa(x, dout, kl_up, sel)
    expected = dependents(clean_oracle, _oracle_msa(perturbed(x, case), dout, kl_up, sel))
    got = _reference_msa(poisoned(x, case), dout, kl_up, sel)
    _assert_nan_exactly(got, _reference_msa(x, dout, kl_up, sel), expected, case.id)
    # Every case reaches the KL, except a NaN in v (the KL's target tau does not depend on v).
    assert torch.isnan(got["kl_rows"].mean()) == (case.name != "v"), case.id


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_warmup_reference_nan_reaches_exactly_its_dependents(case):
    from flash_msa_rt import reference

    x, dout, kl_up = _inputs(1)

    def ref(inputs):
        ins = list(inputs.values())
        out, lse, lse_p, kl_rows = reference.warmup_forward(*ins, SCALE)
        grads = reference.warmup_backward(*ins, out, lse, lse_p, SCALE, dout, kl_up)
        return {"out": out, "lse": lse, "lse_proxy": lse_p, "kl_rows": kl_rows,
                **{f"d{n}": g for n, g in zip(inputs, grads)}}

    def orc(inputs):
        r = oracle.warmup(*inputs.values(), SCALE, grad_out=dout, kl_upstream=kl_up)
        return {"out": r.out, "lse": r.lse, "lse_proxy": r.lse_proxy, "kl_rows": r.kl_rows,
                **{f"d{n}": r.grads[n] for n in inputs}}

    expected = dependents(orc(x), orc(perturbed(x, case)))
    _assert_nan_exactly(ref(poisoned(x, case)), ref(x), expected, case.id)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("q", "k", "v")], ids=lambda c: c.id)
def test_block_sparse_reference_nan_reaches_exactly_its_dependents(case):
    from flash_msa_rt import reference

    x, dout, _ = _inputs(2)
    x = {n: x[n] for n in ("q", "k", "v")}
    g = torch.Generator().manual_seed(3)
    nb = -(-S // BS)
    idx = torch.randint(-1, nb, (B, Hk, S, 3), generator=g, dtype=torch.int32)
    idx[0, 0, case.index] = -1  # the poisoned row, or a row at the poisoned key, has no allowed key: it stays 0

    def ref(inputs):
        out, lse = reference.block_sparse_forward(*inputs.values(), idx, BS, SCALE)
        grads = reference.block_sparse_backward(*inputs.values(), out, lse, idx, BS, SCALE, dout)
        return {"out": out, "lse": lse, **{f"d{n}": g_ for n, g_ in zip(inputs, grads)}}

    def orc(inputs):
        r = oracle.block_sparse(*inputs.values(), idx, BS, SCALE, grad_out=dout)
        return {"out": r.out, "lse": r.lse, **{f"d{n}": r.grads[n] for n in inputs}}

    expected = dependents(orc(x), orc(perturbed(x, case)))
    got = ref(poisoned(x, case))
    _assert_nan_exactly(got, ref(x), expected, case.id)
    G = H // Hk
    assert not got["out"][0, case.index, :G].any() and torch.isinf(got["lse"][0, :G, case.index]).all()


def test_kl_of_a_nan_key_is_nan_not_a_finite_wrong_value():
    """Issue 39: NaN in k gave a finite KL far from the clean one (non-finite lse were zeroed, NaN included)."""
    import flash_msa_rt

    x, _, _ = _inputs(4)
    bhsd = {n: t.float().transpose(1, 2) for n, t in x.items()}
    _, kl_clean = flash_msa_rt.flash_msa_func(*bhsd.values(), K * BS, SCALE, block_size=BS)
    bhsd["k"] = bhsd["k"].clone()
    bhsd["k"][0, 1, 17, 3] = float("nan")
    out, kl = flash_msa_rt.flash_msa_func(*bhsd.values(), K * BS, SCALE, block_size=BS)
    assert torch.isfinite(kl_clean) and torch.isnan(kl)
    out = out.view(B, S, H, D)
    assert torch.isnan(out[0, 17:, 2:]).any() and not torch.isnan(out[0, :17]).any()


def test_nan_proxy_keeps_a_valid_selection_and_makes_kl_nan():
    """A NaN in q_proxy: the selection of its rows is unspecified but valid (local block present, indices in
    range); kl_loss is NaN and q_proxy's gradient is NaN in that row only; out stays finite."""
    import flash_msa_rt

    x, _, _ = _inputs(5)
    bhsd = {n: t.float().transpose(1, 2).contiguous().requires_grad_() for n, t in x.items()}
    with torch.no_grad():
        bhsd["q_proxy"][0, 1, 30, 0] = float("nan")
    sel = flash_msa_rt.select_blocks(bhsd["q_proxy"].detach(), bhsd["k_proxy"].detach(), K * BS, SCALE,
                                     block_size=BS)
    nb = -(-S // BS)
    local = torch.arange(S) // BS
    assert ((sel >= -1) & (sel < nb)).all()
    assert (sel == local.view(1, 1, S, 1)).any(-1).all()
    out, kl = flash_msa_rt.flash_msa_func(*bhsd.values(), K * BS, SCALE, block_size=BS)
    assert torch.isnan(kl) and torch.isfinite(out).all()
    kl.backward()
    dqp = bhsd["q_proxy"].grad
    assert torch.isnan(dqp[0, 1, 30]).all() and torch.isfinite(dqp[0, 0]).all() and torch.isfinite(dqp[0, 1, :30]).all()
