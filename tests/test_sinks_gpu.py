"""Issue 58's options on the GPU: sinks around the kernels (block-sparse, MSA, warmup on cuDNN), proxy_scale on the
kernels (M3's unscaled indexer: proxy_scale 1 beside scale D ** -0.5, through every KL pass and proxy backward),
local_blocks on the selection kernel (its runtime scalar; the full matrix is tests/test_local_blocks_gpu.py), and
the defaults giving the kernels' results bit for bit.

Each kernel result is checked against the float64 reference on the same block indices (flash_msa_rt.tolerances:
the GPU suite's rule, one factor more for out and the main gradients with sinks: out0 is rounded to bf16 before the
sink's factor, flash_msa_rt.ops.sinks). d sinks is a float32 sum, checked against the float64 reference with the
cost of a bf16 out (its delta reads the rounded out).
"""

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
    """float64 d sinks of the out given (the kernels' own, already checked against the oracle: its delta is what the
    backward reads; the exact out rounded to bf16 differs from it by the kernels' own bf16 steps, which a sum over S
    rows turns into ~1e-2, far past a float32 sum's yardstick), cast to dtype first."""
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
    _check("dsinks", s.grad.cpu(), _d_sinks_exact(out.detach().cpu().reshape(out64.shape), lse64, dO.cpu(), sinks.cpu(), torch.float64).float(),
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
    _check("dsinks", s.grad.cpu(), _d_sinks_exact(out.detach().cpu().reshape(out64.shape), lse64, dO.cpu(), sinks.cpu(), torch.float64).float(),
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
            for n, (a, b) in enumerate(zip(got, today)):
                if sparse or n < 2:  # out, kl, and the deterministic sparse backward: bit for bit
                    assert torch.equal(a, b)
                else:  # warmup's backward adds with fp32 atomics (cuDNN's and the proxy kernels'): their order only
                    torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2 * b.float().abs().max())
    finally:
        torch.use_deterministic_algorithms(False)


def test_local_blocks_selection_runs_on_the_kernels():
    """local_blocks > 1 runs on the selection kernel (no fallback, no warning): the reference's rows (near ties
    aside, >= 99.5 % equal) with every row's forced blocks."""
    from tests import routing
    from tests.test_local_blocks_gpu import check_forced_layout

    ins, _, _ = _inputs(1, 700, 4, 1, 2, 1, seed=11)
    sel = api.select_blocks(ins["q_proxy"], ins["k_proxy"], 3 * BS, layout="bshd", local_blocks=2)
    routing.assert_ran_on_kernels(["select_blocks"])
    check_forced_layout(sel, 3, BS, 2)
    want = ref.select_blocks(ins["q_proxy"], ins["k_proxy"], 3, BS, D ** -0.5, local_blocks=2)
    assert (sel == want).all(-1).double().mean().item() >= 0.995


# --- proxy_scale on the kernels ------------------------------------------------------------------------------------
# M3's indexer scores are unscaled (proxy_scale 1) while its main attention takes D ** -0.5: every proxy kernel (the
# forward's KL pass, the deferred KL pass and its proxy lse alone, the proxy backward on the tau path and
# recomputing tau, warmup's dense and sparse proxy kernels) scores the proxy at proxy_scale and the main heads (tau)
# at scale. Checked as tests/test_proxy_dp64_gpu.py checks its ops: through the kernel backend (dispatch must choose
# it), against the float64 reference with the float32 reference as the tolerance's baseline.

PROXY_SCALE = 1.0
PS_SHAPES = [(1, 1001, 8, 2, 2, 1, 4), (2, 777, 8, 2, 8, 1, 3), (1, 900, 16, 2, 2, 1, 4)]  # B, S, H, Hk, Hp, Hpk, K
PS_NAMES = ("out", "lse", "lse_proxy", "kl_rows", "dq_proxy", "dk_proxy", "dq", "dk", "dv")
# tuning overrides that move the proxy's work onto other kernels (all built for sm90a: tests/test_runtime_variants)
ROUTES = {"default": {}, "recompute-tau": {"sparse_bwd": {"tau_path": False}},
          "stepped": {"sparse_bwd": {"tau_path": False, "recompute_heads": "stepped"}},
          "lockstep-kl": {"sparse_fwd": {"schedule": "lockstep", "kl_schedule": "lockstep"}}}


def _ps_inputs(B, S, H, Hk, Hp, Hpk, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    ins = (rnd(B, S, Hp, D), rnd(B, S, Hpk, D), rnd(B, S, H, D), rnd(B, S, Hk, D), rnd(B, S, Hk, D))
    return ins, rnd(B, S, H, D), torch.rand(B, Hp, S, device="cuda", generator=g) + 0.5


def _ps_impl(op, qp, q, k, **extra):
    from flash_msa_rt.ops import kernels

    config = dict(head_dim=D, proxy_head_dim=qp.shape[3], block_size=BS, group=q.shape[2] // qp.shape[2],
                  kv_group=q.shape[2] // k.shape[2], varlen=False, separate_keys=False, proxy_scale=True)
    config.update(extra)
    impl = dispatch.implementation(op, q.device, q.dtype, **config)
    assert impl is kernels.KERNELS.ops[op], f"{op} with proxy_scale != scale does not run on the kernels"
    return impl


def _kl_close(metric, kl_rows64):
    """A KL metric (the mean KL value) against the float64 rows' mean: within 1e-3 relative, the deferred KL's
    target (tests/test_kl_value_gpu.py; the tau path's kl_value variant forms it from tau in the input dtype)."""
    exact = float(kl_rows64.double().mean())
    assert exact > 0 and abs(float(metric) - exact) <= 1e-3 * exact, (float(metric), exact)


def _ps_check(got, want, base, dtype):
    for name, g_, w_, b_ in zip(PS_NAMES, got, want, base, strict=True):
        assert g_.shape == w_.shape, (name, g_.shape, w_.shape)
        result_dtype = torch.float32 if name in ("lse", "lse_proxy", "kl_rows") else dtype
        tolerances.assert_ok(tolerances.check(name, g_, w_, b_, result_dtype=result_dtype))


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("shape", PS_SHAPES, ids=lambda s: "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}_K{}".format(*s))
def test_msa_with_proxy_scale_on_the_kernels(shape, deterministic, route, tuned):
    """Forward (out, lse, lse_proxy, kl_rows), the deferred KL pass (and its proxy lse alone), and the backward's
    five gradients with its KL metric, at proxy_scale 1 and scale D ** -0.5, through the kernel backend against the
    float64 reference."""
    if deterministic and route != "default":
        pytest.skip("the deterministic backward is the tau path's")
    if ROUTES[route]:
        tuned(**ROUTES[route])
    B, S, H, Hk, Hp, Hpk, K = shape
    dtype = torch.bfloat16
    (qp, kp, q, k, v), go, klg = _ps_inputs(B, S, H, Hk, Hp, Hpk, seed=S + 21)
    scale, ps = D ** -0.5, PROXY_SCALE
    sel = _ps_impl("select_blocks", qp, q, k, top_k_blocks=K)(qp, kp, K, BS, ps)
    fwd = _ps_impl("msa_forward", qp, q, k)(qp, kp, q, k, v, sel, BS, scale, proxy_scale=ps)
    kl_impl = _ps_impl("msa_kl", qp, q, k)
    kl_pass = kl_impl(qp, kp, q, k, v, fwd[1], sel, BS, scale, proxy_scale=ps)
    for a, b in zip(kl_pass, fwd[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    lse_alone = kl_impl(qp, kp, q, k, v, fwd[1], sel, BS, scale, with_kl=False, proxy_scale=ps)[0]
    torch.testing.assert_close(lse_alone, fwd[2], rtol=1e-5, atol=1e-6)
    metric = torch.zeros((), device="cuda")
    torch.use_deterministic_algorithms(deterministic)
    try:
        bwd = _ps_impl("msa_backward", qp, q, k, deterministic=deterministic)(
            qp, kp, q, k, v, *fwd[:3], sel, BS, scale, go, klg, kl_metric=metric, proxy_scale=ps)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()

    def reference(dt):
        ins = [t.to(dt) for t in (qp, kp, q, k, v)]
        f = ref.msa_forward(*ins, sel, BS, scale, proxy_scale=ps)
        return (*f, *ref.msa_backward(*ins, *f[:3], sel, BS, scale, go.to(dt), klg.to(dt), proxy_scale=ps))

    want = reference(torch.float64)
    _ps_check((*fwd, *bwd), want, reference(torch.float32), dtype)
    _kl_close(metric, want[3])
    # not the main scale's: the proxy scores really are at proxy_scale
    at_scale = ref.msa_forward(*(t.double() for t in (qp, kp, q, k, v)), sel, BS, scale)[2]
    assert not torch.allclose(fwd[2].double(), at_scale, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dense_proxy", [True, False], ids=["dense-proxy", "sparse-proxy"])
@pytest.mark.parametrize("dense_main", [True, False], ids=["cudnn-main", "sparse-main"])
@pytest.mark.parametrize("shape", PS_SHAPES[:2], ids=lambda s: "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}_K{}".format(*s))
def test_warmup_with_proxy_scale_on_the_kernels(shape, dense_main, dense_proxy, tuned):
    """Warmup forward, its KL pass (and proxy lse alone) and backward with its KL metric at proxy_scale 1, scale
    D ** -0.5: the proxy on the dense warmup kernels or the sparse ones over every causal block, the main attention
    on cuDNN or the sparse kernels, against the float64 reference warmup."""
    tuned(warmup={"dense_main": dense_main, "dense_proxy": dense_proxy})
    B, S, H, Hk, Hp, Hpk, _ = shape
    dtype = torch.bfloat16
    (qp, kp, q, k, v), go, klg = _ps_inputs(B, S, H, Hk, Hp, Hpk, seed=S + 31)
    scale, ps = D ** -0.5, PROXY_SCALE
    fwd = _ps_impl("warmup_forward", qp, q, k, block_size=None)(qp, kp, q, k, v, scale, proxy_scale=ps)
    kl_impl = _ps_impl("warmup_kl", qp, q, k, block_size=None)
    kl_pass = kl_impl(qp, kp, q, k, v, fwd[1], scale, proxy_scale=ps)
    for a, b in zip(kl_pass, fwd[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    lse_alone = kl_impl(qp, kp, q, k, v, fwd[1], scale, with_kl=False, proxy_scale=ps)[0]
    torch.testing.assert_close(lse_alone, fwd[2], rtol=1e-5, atol=1e-6)
    metric = torch.zeros((), device="cuda")
    bwd = _ps_impl("warmup_backward", qp, q, k, block_size=None, deterministic=False)(
        qp, kp, q, k, v, *fwd[:3], scale, go, klg, kl_metric=metric, proxy_scale=ps)
    torch.cuda.synchronize()

    def reference(dt):
        ins = [t.to(dt) for t in (qp, kp, q, k, v)]
        f = ref.warmup_forward(*ins, scale, proxy_scale=ps)
        return (*f, *ref.warmup_backward(*ins, *f[:3], scale, go.to(dt), klg.to(dt), proxy_scale=ps))

    want = reference(torch.float64)
    _ps_check((*fwd, *bwd), want, reference(torch.float32), dtype)
    _kl_close(metric, want[3])


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "warmup"])
@pytest.mark.parametrize("kl_value", ["exact", "deferred"])
def test_public_functions_with_proxy_scale_run_on_the_kernels(sparse, kl_value):
    """flash_msa_func / flash_msa_warmup_func with proxy_scale 1 (and sinks): every op on the kernels (the library
    hands proxy_scale to each), results and gradients against the float64 reference."""
    from tests import routing

    B, S, H, Hk, Hp, Hpk = 1, 1500, 8, 2, 4, 1
    ins, dO, sinks = _inputs(B, S, H, Hk, Hp, Hpk, seed=13)
    leaves = {n: t.requires_grad_() for n, t in ins.items()}
    s = sinks.clone().requires_grad_()
    metric = torch.zeros((), device="cuda")
    fn = api.flash_msa_func if sparse else api.flash_msa_warmup_func
    idx = api.select_blocks(leaves["q_proxy"], leaves["k_proxy"], 4 * BS, layout="bshd",
                            proxy_scale=PROXY_SCALE) if sparse else None
    out, kl = fn(*leaves.values(), 4 * BS, layout="bshd", sinks=s, kl_value=kl_value, kl_metric=metric,
                 proxy_scale=PROXY_SCALE)
    (out.float() * dO.reshape(B, S, -1).float()).sum().add(0.3 * kl).backward()
    routing.assert_ran_on_kernels(["msa_forward", "msa_backward"] if sparse else
                                  ["warmup_forward", "warmup_backward"])
    x64 = [t.detach().double().cpu() for t in leaves.values()]
    kw = dict(sinks=sinks.cpu(), proxy_scale=PROXY_SCALE)
    if sparse:
        out64, lse64, lsep64, kl64 = ref.msa_forward(*x64, idx.cpu(), BS, D ** -0.5, **kw)
        grads64 = ref.msa_backward(*x64, out64, lse64, lsep64, idx.cpu(), BS, D ** -0.5, dO.double().cpu(),
                                   torch.tensor(0.3 / kl64.numel(), dtype=torch.float64), **kw)
    else:
        out64, lse64, lsep64, kl64 = ref.warmup_forward(*x64, D ** -0.5, **kw)
        grads64 = ref.warmup_backward(*x64, out64, lse64, lsep64, D ** -0.5, dO.double().cpu(),
                                      torch.tensor(0.3 / kl64.numel(), dtype=torch.float64), **kw)
    _check("out", out.view(B, S, H, D).cpu(), out64)
    _kl_close(metric, kl64)
    for (name, t), want in zip(leaves.items(), grads64):
        _check(f"d{name}", t.grad.cpu(), want)
    _check("dsinks", s.grad.cpu(), _d_sinks_exact(out.detach().cpu().reshape(out64.shape), lse64, dO.cpu(), sinks.cpu(), torch.float64).float(),
           result_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sink_row_passes_on_the_kernel_equal_torch(head_dim, dtype):
    """The bwd_delta kernel's scale_rows variant (flash_msa_rt.ops.sinks): dO' = exp(lse0 - lse) dO and delta in
    one pass, and out0 scaled in place, against the same formulas in torch (float32 products, one rounding: equal
    up to the last bit of a rounding tie, exp's ulp); 0 where lse0 = -inf, NaN kept; a head slice as the whole."""
    from flash_msa_rt.ops import sinks as sk

    g = torch.Generator(device="cuda").manual_seed(head_dim)
    B, S, H = 2, 301, 6
    dO, out = (torch.randn(B, S, H, head_dim, generator=g, device="cuda").to(dtype) for _ in range(2))
    lse0 = torch.randn(B, H, S, generator=g, device="cuda") * 3
    lse0[0, 1, 5] = float("-inf")
    lse0[1, 2, 7] = float("nan")
    lse = torch.logaddexp(lse0, torch.randn(H, device="cuda", generator=g).view(1, H, 1) + 1)
    assert sk._rows_kernel((dO, out), (lse0, lse), scale_rows=True) is not None, "the scale_rows variant is built"
    scaled, delta = sk.scaled_grad_and_delta(dO, out, lse0, lse)
    want = (dO.float() * sk.kept_mass(lse0, lse).transpose(1, 2).unsqueeze(-1)).to(dtype)
    torch.testing.assert_close(scaled, want, rtol=2 ** -7, atol=0, equal_nan=True)
    assert torch.isnan(scaled[1, 7, 2]).all() and (scaled[0, 5, 1] == 0).all()
    torch.testing.assert_close(delta, (dO.float() * out.float()).sum(-1).transpose(1, 2), rtol=1e-5, atol=1e-5)
    inplace = out.clone()
    assert sk.scale_out_(inplace, lse0, lse) is inplace
    torch.testing.assert_close(inplace, (out.float() * sk.kept_mass(lse0, lse).transpose(1, 2).unsqueeze(-1))
                               .to(dtype), rtol=2 ** -7, atol=0, equal_nan=True)
    strided = dO[:, :, ::2]  # a head slice (strided rows, still 16-byte aligned: the kernel's path)
    s2, d2 = sk.scaled_grad_and_delta(strided, out[:, :, ::2], lse0[:, ::2], lse[:, ::2])
    torch.testing.assert_close(s2, scaled[:, :, ::2], rtol=2 ** -7, atol=0, equal_nan=True)
    torch.testing.assert_close(d2, delta[:, ::2], rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("point", [(64, 64), (128, 64), (64, 128), (128, 128)], ids=lambda p: "D{}_Bs{}".format(*p))
def test_sinks_across_the_matrix_packed_and_deterministic(point):
    """Sinks at every (D, Bs) the kernels serve (the combine's and the row kernel's variants at each), in bf16
    against the float64 reference; a packed batch of two documents equal to each document alone (the sink step
    per row: the pack changes nothing); the deterministic backward bitwise across two runs, d sinks included."""
    Dm, Bs = point
    B, S, H, Hk, Hp, Hpk = 1, 3 * Bs + 77, 8, 2, 2, 1
    g = torch.Generator(device="cuda").manual_seed(Dm + Bs)
    ins = [torch.randn(B, S, h, Dm, generator=g, device="cuda").to(torch.bfloat16) for h in (Hp, Hpk, H, Hk, Hk)]
    sinks = torch.randn(H, generator=g, device="cuda") + 1.0
    dO = torch.randn(B, S, H * Dm, generator=g, device="cuda").to(torch.bfloat16)
    top_k = 2 * Bs

    def run():
        leaves = [t.clone().requires_grad_() for t in ins]
        s = sinks.clone().requires_grad_()
        out, kl = api.flash_msa_func(*leaves, top_k, layout="bshd", block_size=Bs, sinks=s)
        (out.float() * dO.float()).sum().add(0.3 * kl).backward()
        return out.detach(), [t.grad for t in leaves] + [s.grad]

    out, grads = run()
    x64 = [t.double().cpu() for t in ins]
    idx = api.select_blocks(ins[0], ins[1], top_k, layout="bshd", block_size=Bs).cpu()
    out64, lse64, lsep64, kl64 = ref.msa_forward(*x64, idx, Bs, Dm ** -0.5, sinks=sinks.cpu())
    grads64 = ref.msa_backward(*x64, out64, lse64, lsep64, idx, Bs, Dm ** -0.5, dO.double().cpu().view(B, S, H, Dm),
                               torch.tensor(0.3 / kl64.numel(), dtype=torch.float64), sinks=sinks.cpu())
    _check("out", out.view(B, S, H, Dm).cpu(), out64)
    for name, got, want in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), grads, grads64):
        _check(name, got.cpu(), want)

    cut = Bs + 31  # two documents of one row: each equals its own call
    cu = torch.tensor([0, cut, S], dtype=torch.int32, device="cuda")
    out_p, _ = api.flash_msa_func(*ins, top_k, layout="bshd", block_size=Bs, sinks=sinks, cu_seqlens=cu)
    for s0, s1 in ((0, cut), (cut, S)):
        out_1, _ = api.flash_msa_func(*(t[:, s0:s1] for t in ins), top_k, layout="bshd", block_size=Bs, sinks=sinks)
        torch.testing.assert_close(out_p[:, s0:s1].float(), out_1.float(), rtol=1e-2, atol=1e-2)

    torch.use_deterministic_algorithms(True)
    try:
        (o1, g1), (o2, g2) = run(), run()
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
