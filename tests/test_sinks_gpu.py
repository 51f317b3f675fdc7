"""Issue 58's options on the GPU: sinks around the kernels (block-sparse, MSA, warmup on cuDNN), proxy_scale and
local_blocks (the kernels decline them: those calls run on the reference with the one-time warning), and the
defaults giving the kernels' results bit for bit.

Each kernel result is checked against the float64 reference on the same block indices (flash_msa_rt.tolerances:
the GPU suite's rule, one factor more for out and the main gradients with sinks: out0 is rounded to bf16 before the
sink's factor, flash_msa_rt.ops.sinks). d sinks is a float32 sum, checked against the float64 reference with the
cost of a bf16 out (its delta reads the rounded out).
"""

import warnings

import pytest
import torch

import flash_msa_rt.reference as ref
from flash_msa_rt import api, tolerances
from flash_msa_rt.ops import dispatch

pytestmark = pytest.mark.gpu

D, BS = 128, 128


def _inputs(B, S, H, Hk, Hp, Hpk, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = {"q_proxy": Hp, "k_proxy": Hpk, "q": H, "k": Hk, "v": Hk}
    ins = {n: torch.randn(B, S, h, D, generator=g, device="cuda").to(dtype) for n, h in shapes.items()}
    sinks = torch.randn(H, generator=g, device="cuda") + 2.0
    sinks[0] = 40.0  # a head whose sink takes all the mass: its KL target must still come from lse0
    return ins, torch.randn(B, S, H, D, generator=g, device="cuda").to(dtype), sinks


def _check(name, got, exact, factor=tolerances.FACTOR + 1, result_dtype=None):
    tolerances.assert_ok(tolerances.check(name, got, exact, result_dtype=result_dtype, factor=factor))


def _d_sinks_exact(out64, lse64, dO, sinks, dtype):
    """float64 d sinks from the exact out rounded to dtype (what the kernels' delta reads)."""
    delta = (dO.double() * out64.to(dtype).double()).sum(-1).transpose(1, 2)
    return -(torch.exp(sinks.double().view(1, -1, 1) - lse64) * delta).sum((0, 2))


@pytest.mark.parametrize("B, S, H, Hk, Hi", [(1, 1000, 8, 2, 2), (2, 777, 16, 4, 4)])
def test_block_sparse_attention_with_sinks_on_the_kernels(B, S, H, Hk, Hi):
    ins, dO, sinks = _inputs(B, S, H, Hk, 1, 1, seed=S)
    nb = -(-S // BS)
    g = torch.Generator(device="cuda").manual_seed(1)
    idx = torch.randint(-1, nb, (B, Hi, S, 4), generator=g, device="cuda", dtype=torch.int32)
    idx[0, 0, S // 2] = -1  # a row with no allowed key: out 0, lse = sink
    q, k, v = (ins[n].requires_grad_() for n in ("q", "k", "v"))
    s = sinks.clone().requires_grad_()
    out, lse = api.block_sparse_attention(q, k, v, idx, BS, layout="bshd", return_lse=True, sinks=s)
    (out * dO).float().sum().backward()
    q64, k64, v64 = (t.detach().double().cpu() for t in (q, k, v))
    out64, lse64 = ref.block_sparse_forward(q64, k64, v64, idx.cpu(), BS, D ** -0.5, sinks=sinks.cpu())
    grads64 = ref.block_sparse_backward(q64, k64, v64, out64, lse64, idx.cpu(), BS, D ** -0.5, dO.double().cpu(),
                                        sinks=sinks.cpu())
    _check("out", out.cpu(), out64)
    _check("lse", lse.cpu(), lse64, result_dtype=torch.float32, factor=tolerances.FACTOR)
    for name, t, want in zip(("dq", "dk", "dv"), (q, k, v), grads64):
        _check(name, t.grad.cpu(), want)
    _check("dsinks", s.grad.cpu(), _d_sinks_exact(out64, lse64, dO.cpu(), sinks.cpu(), torch.bfloat16).float(),
           result_dtype=torch.float32)
    assert not out[0, S // 2, : H // Hi].any() and torch.equal(lse[0, : H // Hi, S // 2], sinks[: H // Hi])


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "warmup"])
@pytest.mark.parametrize("kl_value", ["exact", "deferred"])
def test_msa_and_warmup_with_sinks_on_the_kernels(sparse, kl_value):
    B, S, H, Hk, Hp, Hpk = 1, 1500, 8, 2, 4, 1
    ins, dO, sinks = _inputs(B, S, H, Hk, Hp, Hpk, seed=7)
    leaves = {n: t.requires_grad_() for n, t in ins.items()}
    s = sinks.clone().requires_grad_()
    metric = torch.zeros((), device="cuda")
    fn = api.flash_msa_func if sparse else api.flash_msa_warmup_func
    idx = api.select_blocks(leaves["q_proxy"], leaves["k_proxy"], 4 * BS, layout="bshd") if sparse else None
    out, kl = fn(*leaves.values(), 4 * BS, layout="bshd", sinks=s, kl_value=kl_value, kl_metric=metric)
    (out.float() * dO.reshape(B, S, -1).float()).sum().add(0.3 * kl).backward()
    x64 = [t.detach().double().cpu() for t in leaves.values()]
    if sparse:
        out64, lse64, lsep64, kl64 = ref.msa_forward(*x64, idx.cpu(), BS, D ** -0.5, sinks=sinks.cpu())
        grads64 = ref.msa_backward(*x64, out64, lse64, lsep64, idx.cpu(), BS, D ** -0.5, dO.double().cpu(),
                                   torch.tensor(0.3 / kl64.numel(), dtype=torch.float64), sinks=sinks.cpu())
    else:
        out64, lse64, lsep64, kl64 = ref.warmup_forward(*x64, D ** -0.5, sinks=sinks.cpu())
        grads64 = ref.warmup_backward(*x64, out64, lse64, lsep64, D ** -0.5, dO.double().cpu(),
                                      torch.tensor(0.3 / kl64.numel(), dtype=torch.float64), sinks=sinks.cpu())
    _check("out", out.view(B, S, H, D).cpu(), out64)
    _check("kl", metric.cpu(), kl64.mean(), result_dtype=torch.float32, factor=tolerances.FACTOR)
    for (name, t), want in zip(leaves.items(), grads64):
        _check(f"d{name}", t.grad.cpu(), want)
    _check("dsinks", s.grad.cpu(), _d_sinks_exact(out64, lse64, dO.cpu(), sinks.cpu(), torch.bfloat16).float(),
           result_dtype=torch.float32)


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "warmup"])
def test_defaults_are_the_kernels_results_bit_for_bit(sparse):
    ins, dO, _ = _inputs(1, 2000, 8, 2, 4, 1, seed=9)
    fn = api.flash_msa_func if sparse else api.flash_msa_warmup_func
    torch.use_deterministic_algorithms(sparse)  # bitwise-reproducible backward where the kernels have one
    try:
        def run(**kw):
            leaves = [t.detach().clone().requires_grad_() for t in ins.values()]
            out, kl = fn(*leaves, 4 * BS, layout="bshd", **kw)
            (out.float() * dO.reshape(*out.shape).float()).sum().add(kl).backward()
            return [out, kl, *(t.grad for t in leaves)]

        today = run()
        for got in (run(sinks=None, proxy_scale=D ** -0.5, local_blocks=1),):
            for a, b in zip(got, today):
                assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(False)


def test_proxy_scale_and_local_blocks_run_on_the_reference_with_a_warning():
    """Until the kernels take them (kernels_src/select: local_blocks; the KL kernels: proxy_scale), those calls
    run on the reference, and dispatch says so once; never silently wrong."""
    ins, _, _ = _inputs(1, 700, 4, 1, 2, 1, seed=11)
    dispatch.reset_warnings()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sel = api.select_blocks(ins["q_proxy"], ins["k_proxy"], 3 * BS, layout="bshd", local_blocks=2)
    assert any("local_blocks" in str(w.message) for w in seen)
    want = ref.select_blocks(ins["q_proxy"].cpu(), ins["k_proxy"].cpu(), 3, BS, D ** -0.5, local_blocks=2)
    assert torch.equal(sel.cpu(), want)
    dispatch.reset_warnings()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, kl = api.flash_msa_func(*ins.values(), 3 * BS, layout="bshd", proxy_scale=1.0)
    assert any("proxy_scale" in str(w.message) for w in seen)
    assert torch.isfinite(kl) and torch.isfinite(out).all()
