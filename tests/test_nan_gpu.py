"""NaN propagation on the kernels (msa-semantics.md, "Non-finite inputs"): a NaN in one query row of q or q_proxy,
or one key of k, k_proxy or v, must show as NaN in every result that depends on it (out, lse, lse_proxy, KL rows,
kl_loss, the five gradients), as the reference does (tests/test_nan_propagation.py).

Where NaN must appear: the dense float64 oracle's dependence set (tests/nan_cases.py). A kernel multiplies whole
tiles, so 0 * NaN may also reach results of rows and keys that share a selected block with the NaN without depending
on it (a row before a NaN key of its own block, a key after a NaN row's position); NaN is allowed there, and only
there: the upper bound is the oracle's dependence set with every listed block allowed whole (no causal cut inside
it). Every result outside the NaN keeps its clean value (within the atomics' reordering).
"""

import pytest
import torch

from flash_msa_rt import tolerances
from tests import oracle
from tests.nan_cases import CASES, dependents, perturbed, poisoned

pytestmark = pytest.mark.gpu

B, S, H, Hk, Hp, Hpk, D, BS, K = 1, 700, 8, 2, 2, 1, 128, 128, 3
SCALE = D ** -0.5
GPU_CASES = [type(c)(c.name, 300, {"q": 5}.get(c.name, c.head), c.whole) for c in CASES]  # token 300: block 2

def _inputs(dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = {"q_proxy": (B, S, Hp, D), "k_proxy": (B, S, Hpk, D), "q": (B, S, H, D), "k": (B, S, Hk, D),
              "v": (B, S, Hk, D)}
    x = {n: torch.randn(s, device="cuda", generator=g).to(dtype) for n, s in shapes.items()}
    dout = torch.randn(B, S, H, D, device="cuda", generator=g).to(dtype)
    kl_up = torch.rand(B, Hp, S, device="cuda", generator=g) + 0.5
    return x, dout, kl_up


def _kernels_msa(x, dout, kl_up, sel):
    """The MSA custom ops with autograd on a fixed selection, checked to run on the kernels."""
    from flash_msa_rt.ops import library
    from flash_msa_rt.selftest import on_kernels, resolved_backends

    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    with resolved_backends() as seen:
        out, lse, lse_p, kl_rows = library.msa_forward(*leaves.values(), sel, BS, SCALE)
        grads = torch.autograd.grad((out.float() * dout.float()).sum() + (kl_rows * kl_up).sum(),
                                    list(leaves.values()))
    torch.cuda.synchronize()
    assert on_kernels(seen, ("msa_forward", "msa_backward")) is None, seen
    return {"out": out, "lse": lse, "lse_proxy": lse_p, "kl_rows": kl_rows,
            **{f"d{n}": g for n, g in zip(x, grads)}}


def _oracle(x, dout, kl_up, allowed, sel):
    ins = [t.double() for t in x.values()]
    r = oracle._with_grads(*ins, allowed, SCALE, dout.double(), kl_up.double(), sel)
    return {"out": r.out, "lse": r.lse, "lse_proxy": r.lse_proxy, "kl_rows": r.kl_rows,
            **{f"d{n}": r.grads[n] for n in x}}


def _whole_blocks(sel):
    """(B, Hp, S, S): every key of every listed block, no causal cut inside a block (the tile-level reach)."""
    blk_of_t = torch.arange(S, device=sel.device) // BS
    return (sel.long().unsqueeze(-1) == blk_of_t).any(dim=-2)


def _check(got, clean, lower, upper, what):
    """Every result at once, so a failure lists all the results that hide (or invent) a NaN."""
    problems = []
    for name, want in lower.items():
        nan = torch.isnan(got[name])
        missing = int((want & ~nan).sum())
        extra = int((nan & ~upper[name]).sum())
        if missing:
            problems.append(f"{name}: {missing} of {int(want.sum())} results that depend on the NaN are not NaN "
                            f"(e.g. {got[name][want & ~nan].flatten()[:3].tolist()})")
        if extra:
            problems.append(f"{name}: {extra} results NaN beyond the NaN's blocks")
        keep = ~nan & ~want
        # Outside the NaN's reach a result keeps its clean value, up to the atomics' order of the gradients.
        c = clean[name][keep]
        same = tolerances.compare(name, got[name][keep], c, 2e-2 * max(1.0, tolerances.magnitude(c)))
        if not same.ok:
            problems.append(f"{name} changed outside the NaN: {same.problem}")
    assert not problems, f"{what}: " + "; ".join(problems)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_msa_kernels_propagate_nan(case, dtype):
    from flash_msa_rt.ops.select import select_blocks_cuda

    x, dout, kl_up = _inputs(dtype)
    sel = select_blocks_cuda(x["q_proxy"], x["k_proxy"], K, BS, SCALE)  # clean: NaN makes selection unspecified
    causal = oracle.allowed_from_indices(sel, S, BS)
    whole = _whole_blocks(sel)
    lower = dependents(_oracle(x, dout, kl_up, causal, sel), _oracle(perturbed(x, case), dout, kl_up, causal, sel))
    upper = dependents(_oracle(x, dout, kl_up, whole, sel), _oracle(perturbed(x, case), dout, kl_up, whole, sel))
    got = _kernels_msa(poisoned(x, case), dout, kl_up, sel)
    _check(got, _kernels_msa(x, dout, kl_up, sel), lower, upper, case.id)
    assert torch.isnan(got["kl_rows"].sum()) == (case.name != "v"), f"{case.id}: kl_loss"


@pytest.mark.parametrize("case", [c for c in GPU_CASES if c.name in ("q", "k", "v")], ids=lambda c: c.id)
def test_block_sparse_kernels_propagate_nan(case):
    from flash_msa_rt import block_sparse_attention
    from flash_msa_rt.selftest import block_sparse_indices, on_kernels, resolved_backends

    x, dout, _ = _inputs(torch.bfloat16, seed=1)
    x = {n: x[n] for n in ("q", "k", "v")}
    g = torch.Generator(device="cuda").manual_seed(2)
    idx = block_sparse_indices(B, Hk, S, K, g, "cuda")

    def run(inputs):
        leaves = [t.detach().requires_grad_() for t in inputs.values()]
        with resolved_backends() as seen:
            out, lse = block_sparse_attention(*leaves, idx, BS, SCALE, layout="bshd", return_lse=True)
            grads = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)
        assert on_kernels(seen, ("block_sparse_forward", "block_sparse_backward")) is None, seen
        return {"out": out, "lse": lse, **{f"d{n}": gr for n, gr in zip(inputs, grads)}}

    def orc(inputs, allowed):
        r = oracle._with_grads(None, None, *(t.double() for t in inputs.values()), allowed, SCALE, dout.double(),
                               None, idx)
        return {"out": r.out, "lse": r.lse, **{f"d{n}": r.grads[n] for n in inputs}}

    causal = oracle.allowed_from_indices(idx, S, BS)
    whole = _whole_blocks(idx)
    lower = dependents(orc(x, causal), orc(perturbed(x, case), causal))
    upper = dependents(orc(x, whole), orc(perturbed(x, case), whole))
    _check(run(poisoned(x, case)), run(x), lower, upper, case.id)


@pytest.mark.parametrize("kl_value", ["exact", "deferred"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_warmup_kernels_propagate_nan(case, kl_value):
    """Deferred: kl_loss's value is the kl_metric the backward writes (G = 4: the proxy lse alone, then the value
    from the proxy backward)."""
    import flash_msa_rt
    from flash_msa_rt.selftest import on_kernels, resolved_backends

    x, dout, kl_up = _inputs(torch.bfloat16, seed=3)
    coef = float(B * Hp * S)  # d loss / d KL_p(i) = 1

    def run(inputs):
        leaves = {n: t.detach().requires_grad_() for n, t in inputs.items()}
        metric = torch.zeros((), device="cuda")
        with resolved_backends() as seen:
            out, kl = flash_msa_rt.flash_msa_warmup_func(*leaves.values(), K * BS, SCALE, layout="bshd",
                                                         kl_value=kl_value, kl_metric=metric)
            grads = torch.autograd.grad((out.view(B, S, H, D).float() * dout.float()).sum() + coef * kl,
                                        list(leaves.values()))
        assert on_kernels(seen, ("warmup_forward", "warmup_backward")) is None, seen
        return {"out": out.view(B, S, H, D), "kl_loss": metric.view(1),
                **{f"d{n}": gr for n, gr in zip(inputs, grads)}}

    def orc(inputs, allowed):
        r = oracle._with_grads(*(t.double() for t in inputs.values()), allowed, SCALE, dout.double(),
                               torch.ones((), dtype=torch.float64, device="cuda") * coef, None)
        return {"out": r.out, "kl_loss": r.kl_loss.view(1), **{f"d{n}": r.grads[n] for n in inputs}}

    i = torch.arange(S, device="cuda")
    causal = (i.view(1, -1) <= i.view(-1, 1)).view(1, 1, S, S)
    whole = ((i.view(1, -1) // BS) <= (i.view(-1, 1) // BS)).view(1, 1, S, S)  # tiles of up to 128 x 128
    lower = dependents(orc(x, causal), orc(perturbed(x, case), causal))
    upper = dependents(orc(x, whole), orc(perturbed(x, case), whole))
    _check(run(poisoned(x, case)), run(x), lower, upper, case.id)
