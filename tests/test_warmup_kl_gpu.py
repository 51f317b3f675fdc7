"""The dense warmup proxy kernels on the H200: the KL pass (kernels_src.warmup_kl) and the proxy backward
(kernels_src.warmup_bwd_proxy), both behind flash_msa_rt.ops.warmup_kl. lse_proxy, kl_rows, dq_proxy and dk_proxy
against the float64 reference on the reference's own main statistics, with the tolerance of the same computation
in float32 (4x; the gradients also their rounding to the input dtype; plus an atol); odd S including partial
tiles, G in {1, 2, 4}, GQA main heads and shared proxy keys; large logits; and the same results as the sparse
kernels over the all-causal selection."""

import pytest
import torch

pytestmark = pytest.mark.gpu  # conftest skips it without a usable GPU (fails under FLASH_MSA_REQUIRE_GPU=1)

# (B, S, H, Hk, Hp, Hpk): G = H / Hp in {1, 2, 4}
SHAPES = [
    (1, 1, 4, 1, 1, 1),
    (1, 63, 4, 4, 4, 1),
    (2, 129, 8, 2, 4, 2),
    (1, 700, 8, 2, 2, 1),
    (2, 1537, 8, 8, 8, 1),
    (1, 2049, 16, 4, 4, 4),
]


def _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed, std=1.0, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * std).to(dtype)

    return rnd(B, S, Hp, D), rnd(B, S, Hpk, D), rnd(B, S, H, D), rnd(B, S, Hk, D), rnd(B, S, Hk, D)


def _reference(qp, kp, q, k, v, scale, dt):
    from flash_msa_rt import reference

    return reference.warmup_forward(*(t.to(dt) for t in (qp, kp, q, k, v)), scale)


def test_the_dense_pass_is_usable_here():
    """On the H200 with the default artifacts, warmup's KL runs on the dense kernel for every group it is built for
    (else the tests below would test nothing new)."""
    from flash_msa_rt.loader import built_values, device_arch
    from flash_msa_rt.ops import warmup_kl

    groups = built_values("warmup_kl", "group", device_arch(torch.cuda.current_device()))
    assert groups == (1, 2, 4), groups  # the KL pass keeps the G + 1 query tiles of a CTA in shared memory
    for G in groups:
        for dtype in (torch.bfloat16, torch.float16):
            q = torch.empty(1, 1, 4 * G, 128, device="cuda", dtype=dtype)
            for op in ("warmup_kl", "warmup_bwd_proxy"):
                assert warmup_kl.usable(torch.empty(1, 1, 4, 128, device="cuda", dtype=dtype), q, op) is None
    for G in (8, 16):  # the proxy backward runs them in chunks of 4 heads; the KL pass does not
        qp = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(1, 1, G, 128, device="cuda", dtype=torch.bfloat16)
        assert warmup_kl.usable(qp, q, "warmup_bwd_proxy") is None
        assert "G" in warmup_kl.usable(qp, q, "warmup_kl")


SCHEDULES = ("lockstep", "pingpong")  # both builds of the KL pass, whichever the runtime picks


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}".format(*s))
def test_dense_warmup_kl_matches_reference(shape, dtype, schedule, tuned):
    from flash_msa_rt.ops import warmup_kl
    from tests.oracle import assert_close, dtype_error

    tuned(warmup={"kl_schedule": schedule})

    B, S, H, Hk, Hp, Hpk = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S + H)
    scale = 128 ** -0.5
    want = _reference(qp, kp, q, k, v, scale, torch.float64)
    base = _reference(qp, kp, q, k, v, scale, torch.float32)
    got = warmup_kl.warmup_kl_cuda(qp, kp, q, k, want[1].float(), scale)
    for name, g_, w_, b_ in zip(("lse_proxy", "kl_rows"), got, want[2:], base[2:]):
        assert_close(name, g_, w_, dtype_error(w_, b_), factor=4.0, atol=1e-5 * max(1.0, w_.abs().max().item()))


# The proxy backward also takes G = 8 and 16 (chunks of 4 heads per launch).
BACKWARD_SHAPES = SHAPES + [(1, 700, 16, 2, 2, 1), (2, 257, 32, 2, 2, 1), (1, 1000, 16, 1, 1, 1)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dense_warmup_kl_writes_every_row(schedule):
    """Outputs poisoned with NaN before the kernel runs: every (b, p, i) row of lse_proxy and kl_rows is written,
    S not a multiple of the 128-query tile."""
    from flash_msa_rt.loader import get_kernel
    from flash_msa_rt.ops import warmup_kl

    B, S, H, Hk, Hp, Hpk = 2, 333, 8, 2, 2, 1
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=3)
    lse = torch.randn(B, H, S, device="cuda") + 6
    outs = [torch.full((B, Hp, S), float("nan"), device="cuda") for _ in range(2)]
    kernel = get_kernel("warmup_kl", warmup_kl.kernel_config("bf16", 128, H // Hp, schedule), q.device)
    kernel(q=q, k=k, q_proxy=qp, k_proxy=kp, lse=lse, lse_proxy=outs[0], kl_rows=outs[1], scale=0.1, proxy_scale=0.1,
           hp_per_hk=1, hp_per_hpk=2)
    for name, t in zip(("lse_proxy", "kl_rows"), outs):
        assert not torch.isnan(t).any(), f"{name}: {int(torch.isnan(t).sum())} rows not written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=lambda s: "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}".format(*s))
def test_dense_warmup_proxy_backward_matches_reference(shape, dtype):
    from flash_msa_rt import reference
    from flash_msa_rt.ops import warmup_kl
    from tests.oracle import assert_close, dtype_error

    B, S, H, Hk, Hp, Hpk = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S + 2 * H)
    scale = 128 ** -0.5
    g = torch.Generator(device="cuda").manual_seed(S + 3)
    go = torch.randn(q.shape, device="cuda", generator=g).to(dtype)
    klg = torch.rand(B, Hp, S, device="cuda", generator=g) + 0.5
    grads = {}
    for dt in (torch.float64, torch.float32):
        ins = [t.to(dt) for t in (qp, kp, q, k, v)]
        f = reference.warmup_forward(*ins, scale)
        grads[dt] = (f, reference.warmup_backward(*ins, *f[:3], scale, go.to(dt), klg.to(dt)))
    (f64, want), (_, base) = grads[torch.float64], grads[torch.float32]
    got = warmup_kl.warmup_proxy_backward_cuda(qp, kp, q, k, f64[1].float(), f64[2].float(), scale, klg)
    for name, g_, w_, b_ in zip(("dq_proxy", "dk_proxy"), got, want[:2], base[:2]):
        assert g_.dtype == dtype, name
        mag = w_.abs().max().item()
        assert_close(name, g_, w_, dtype_error(w_, b_, w_.to(dtype)), factor=4.0, atol=1e-5 * max(1.0, mag))


@pytest.mark.parametrize("shape", [(2, 3000, 16, 4, 4, 1), (1, 2500, 32, 2, 2, 1)], ids=("G4", "G16"))
def test_dense_and_sparse_proxy_backward_agree(shape):
    """The dense proxy backward and the sparse one over the all-causal selection: the same gradients up to
    float32 summation order and the bf16 rounding of the outputs (G = 16: four chunked launches)."""
    from flash_msa_rt.ops import sparse_bwd, sparse_fwd, warmup_kl
    from flash_msa_rt.ops.kernels import WARMUP_BLOCK, AllCausalBlocks, dense_main

    B, S, H, Hk, Hp, Hpk = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=10)
    scale = 128 ** -0.5
    _, lse = dense_main.dense_forward(q, k, v, scale)
    lse_p, _ = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, AllCausalBlocks(qp, WARMUP_BLOCK), WARMUP_BLOCK, scale)
    klg = torch.full((B, Hp, S), 1.0 / (B * Hp * S), device="cuda")
    dense = warmup_kl.warmup_proxy_backward_cuda(qp, kp, q, k, lse, lse_p, scale, klg)
    sparse = sparse_bwd.proxy_backward_cuda(qp, kp, q, k, lse, lse_p, AllCausalBlocks(qp, WARMUP_BLOCK), WARMUP_BLOCK,
                                            scale, klg)
    for name, d, s_ in zip(("dq_proxy", "dk_proxy"), dense, sparse):
        err = (d.float() - s_.float()).abs().max().item()
        assert err <= 1e-2 * s_.float().abs().max().item(), (name, err, s_.float().abs().max().item())


def _kl_given_lse(qp, kp, q, k, lse, scale):
    """float64 warmup KL rows from a given main lse (B, H, S), tau renormalised by its sum as the kernel does:
    what the lse's own rounding costs, apart from the kernel's arithmetic."""
    B, S, H, _ = q.shape
    Hp, Hk, Hpk = qp.shape[2], k.shape[2], kp.shape[2]
    G = H // Hp
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    kl = torch.empty(B, Hp, S, dtype=torch.float64, device=q.device)
    for p in range(Hp):
        tau = 0
        for h in range(p * G, (p + 1) * G):
            s = scale * q[:, :, h].double() @ k[:, :, h // (H // Hk)].double().transpose(1, 2)
            tau = tau + torch.where(causal, torch.exp(s - lse[:, h].double().unsqueeze(-1)), 0.0)
        tau = tau / tau.sum(-1, keepdim=True)
        s_p = scale * qp[:, :, p].double() @ kp[:, :, p // (Hp // Hpk)].double().transpose(1, 2)
        log_pi = torch.log_softmax(torch.where(causal, s_p, float("-inf")), dim=-1)
        kl[:, p] = torch.where(tau > 0, tau * (torch.log(tau.clamp(min=1e-300)) - log_pi), 0.0).sum(-1)
    return kl


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_warmup_kl_large_logits(dtype, schedule, tuned):
    """Inputs of standard deviation 6 (fp16) / 30 (bf16) per element: logits with standard deviations in the
    hundreds, rows whose tau sits on one key, large per-row shifts. Finite, and within 4x the error of the float32
    computation plus what the fp32 rounding of the given lse costs in float64 (a relative error e of tau costs
    e |ln tau - ln pi| in KL: at KL values in the thousands, an lse of magnitude 4000 rounded to fp32 moves KL by
    a few tenths)."""
    from flash_msa_rt.ops import warmup_kl
    from tests.oracle import assert_close, dtype_error

    tuned(warmup={"kl_schedule": schedule})
    qp, kp, q, k, lse, scale, want, base, lse_cost = _large_logits(dtype)
    got = warmup_kl.warmup_kl_cuda(qp, kp, q, k, lse, scale)
    for name, g_, w_, b_, extra in zip(("lse_proxy", "kl_rows"), got, want[2:], base[2:], (0.0, lse_cost)):
        assert torch.isfinite(g_).all(), name
        assert_close(name, g_, w_, dtype_error(w_, b_) + extra, factor=4.0,
                     atol=1e-5 * max(1.0, w_.abs().max().item()))


def _large_logits(dtype):
    """test_dense_warmup_kl_large_logits' problem: (q_proxy, k_proxy, q, k, the float64 reference's lse in fp32,
    scale, the float64 and float32 references' outputs, what that lse's rounding costs the KL in float64)."""
    B, S, H, Hk, Hp, Hpk = 1, 777, 8, 2, 2, 1
    std = 30.0 if dtype == torch.bfloat16 else 6.0
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=5, std=std)
    scale = 128 ** -0.5
    want = _reference(qp, kp, q, k, v, scale, torch.float64)
    base = _reference(qp, kp, q, k, v, scale, torch.float32)
    lse = want[1].float()
    lse_cost = (_kl_given_lse(qp, kp, q, k, lse, scale) - want[3]).abs().max().item()
    return qp, kp, q, k, lse, scale, want, base, lse_cost


def test_dense_and_sparse_passes_agree():
    """The warmup forward with the dense pass and with the sparse pass over the all-causal selection (what runs
    where the dense one is not built): the same statistics up to float32 summation order."""
    from flash_msa_rt import tuning
    from flash_msa_rt.ops import dispatch

    B, S, H, Hk, Hp, Hpk = 2, 3000, 16, 4, 4, 1
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=9)
    scale = 128 ** -0.5
    impl = dispatch.implementation("warmup_forward", torch.device("cuda"), torch.bfloat16, head_dim=128,
                                   proxy_head_dim=128, block_size=None, group=H // Hp, kv_group=H // Hk, varlen=False)
    dense = impl(qp, kp, q, k, v, scale)
    with tuning.override(warmup={"dense_proxy": False}):
        sparse = impl(qp, kp, q, k, v, scale)
    for name, d, s in zip(("lse_proxy", "kl_rows"), dense[2:], sparse[2:]):
        err = (d - s).abs().max().item()
        assert err <= 1e-4 * max(1.0, s.abs().max().item()), (name, err)


# --- deferred KL mode: the proxy lse alone (warmup_kl kl_value = 0), the KL value from the proxy backward ---------

@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}".format(*s))
def test_proxy_lse_alone_is_the_kl_pass_lse_bitwise(shape, dtype, schedule, tuned):
    """warmup_lse_cuda runs the KL pass's row statistics over the same tiles in the same order: its lse_proxy is
    the KL pass's bit for bit (either schedule), so deferred mode's proxy gradients see the exact mode's lse."""
    from flash_msa_rt.ops import warmup_kl

    tuned(warmup={"kl_schedule": schedule})
    B, S, H, Hk, Hp, Hpk = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S + 5 * H)
    scale = 128 ** -0.5
    lse = torch.randn(B, H, S, device="cuda") + 4
    full, _ = warmup_kl.warmup_kl_cuda(qp, kp, q, k, lse, scale)
    alone = warmup_kl.warmup_lse_cuda(qp, kp, scale)
    assert torch.equal(alone, full), (alone - full).abs().max().item()


def test_proxy_lse_alone_writes_every_row_and_keeps_nan():
    """Output poisoned with NaN: every row written (S not a multiple of the tile); a NaN in one k_proxy row makes
    the lse of exactly the rows that see it NaN (msa-semantics: NaN reaches every output it touches)."""
    from flash_msa_rt.ops import warmup_kl

    B, S, Hp, Hpk = 2, 333, 4, 2
    qp, kp, *_ = _inputs(B, S, 4, 1, Hp, Hpk, torch.bfloat16, seed=11)
    lse = warmup_kl.warmup_lse_cuda(qp, kp, 0.1)
    assert torch.isfinite(lse).all(), int((~torch.isfinite(lse)).sum())
    kp[1, 200, 0] = float("nan")
    lse = warmup_kl.warmup_lse_cuda(qp, kp, 0.1)
    seen = torch.zeros(B, Hp, S, dtype=torch.bool, device="cuda")
    seen[1, :Hp // Hpk, 200:] = True  # proxy heads 0 .. Hp / Hpk - 1 read proxy key head 0; rows i >= 200
    assert torch.equal(torch.isnan(lse), seen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}".format(*s))
def test_proxy_backward_kl_value_is_the_kl_pass_value(shape, dtype):
    """The kl_value variant of the proxy backward: kl_rows against the float64 reference (the KL pass's
    tolerance) and against the KL pass's own rows on the same lse (the same tau and s_p in the same order); its
    gradients the plain variant's (dq_proxy bitwise: one CTA per row; dk_proxy up to its atomics' order)."""
    from flash_msa_rt.ops import warmup_kl
    from tests.oracle import assert_close, dtype_error

    B, S, H, Hk, Hp, Hpk = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S + 7 * H)
    scale = 128 ** -0.5
    want = _reference(qp, kp, q, k, v, scale, torch.float64)
    base = _reference(qp, kp, q, k, v, scale, torch.float32)
    lse = want[1].float()
    lse_p, kl_pass = warmup_kl.warmup_kl_cuda(qp, kp, q, k, lse, scale)
    klg = torch.rand(B, Hp, S, device="cuda", generator=torch.Generator(device="cuda").manual_seed(S)) + 0.5
    kl_rows = torch.full((B, Hp, S), float("nan"), device="cuda")
    with_kl = warmup_kl.warmup_proxy_backward_cuda(qp, kp, q, k, lse, lse_p, scale, klg, kl_rows)
    plain = warmup_kl.warmup_proxy_backward_cuda(qp, kp, q, k, lse, lse_p, scale, klg)
    assert_close("kl_rows", kl_rows, want[3], dtype_error(want[3], base[3]), factor=4.0,
                 atol=1e-5 * max(1.0, want[3].abs().max().item()))
    torch.testing.assert_close(kl_rows, kl_pass, rtol=1e-5, atol=1e-6 * max(1.0, kl_pass.abs().max().item()))
    print(f"\n{shape} {dtype}: kl_rows equal to the KL pass's bit for bit: {torch.equal(kl_rows, kl_pass)}")
    assert torch.equal(with_kl[0], plain[0])
    torch.testing.assert_close(with_kl[1].float(), plain[1].float(), rtol=1e-2, atol=1e-2 * plain[1].float().abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_proxy_backward_kl_value_large_logits(dtype):
    """test_dense_warmup_kl_large_logits for the KL value the proxy backward forms."""
    from flash_msa_rt.ops import warmup_kl
    from tests.oracle import assert_close, dtype_error

    qp, kp, q, k, lse, scale, want, base, lse_cost = _large_logits(dtype)
    lse_p = warmup_kl.warmup_lse_cuda(qp, kp, scale)
    kl_rows = torch.empty(lse_p.shape, device="cuda")
    warmup_kl.warmup_proxy_backward_cuda(qp, kp, q, k, lse, lse_p, scale, torch.ones(lse_p.shape, device="cuda"),
                                         kl_rows)
    assert torch.isfinite(kl_rows).all()
    assert_close("kl_rows", kl_rows, want[3], dtype_error(want[3], base[3]) + lse_cost, factor=4.0,
                 atol=1e-5 * max(1.0, want[3].abs().max().item()))


def test_proxy_backward_kl_value_needs_a_whole_group():
    """G = 8 runs as two launches of G = 4, each with half of tau: the KL value is refused there (the op falls back
    to the KL pass), with a reason naming G."""
    from flash_msa_rt.ops import warmup_kl

    qp = torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16)
    for G, ok in ((1, True), (2, True), (4, True), (8, False), (16, False)):
        q = torch.empty(1, 1, G, 128, device="cuda", dtype=torch.bfloat16)
        why = warmup_kl.usable(qp, q, "warmup_bwd_proxy_kl")
        assert (why is None) == ok and (ok or f"G {G}" in why), (G, why)
    assert warmup_kl.usable(qp, q, "warmup_lse") is None
