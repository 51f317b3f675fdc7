"""Warmup mode on the H200 (issue 5): dense causal main attention on cuDNN (flash_msa_rt.ops.dense_main) and the
proxy's KL pass and backward on the dense warmup kernels (G 1 / 4; G = 8: the KL pass on the sparse kernels with
every causal block selected, the backward in chunked launches), against the reference warmup ops. Tolerances
(flash_msa_rt.tolerances, as the sparse kernels' tests): 4x the error of the same computation in float32 or the
input dtype's rounding, against float64, plus 1e-5 of the scale; S = 16K on sampled rows (float64 over all of it
would take minutes). Results made without atomics match bitwise."""

import pytest
import torch

pytestmark = pytest.mark.gpu  # conftest skips it without a usable GPU (fails under FLASH_MSA_REQUIRE_GPU=1)

NAMES = ("out", "lse", "lse_proxy", "kl_rows", "dq_proxy", "dk_proxy", "dq", "dk", "dv")
# (B, S, H, Hk, Hp, Hpk): G = H / Hp in {1, 4, 8}; GQA and MHA main heads; odd S
SHAPES = [
    (1, 700, 8, 2, 2, 1),
    (2, 1537, 8, 8, 8, 1),
    (1, 2049, 16, 2, 2, 1),
    (1, 1000, 16, 4, 4, 2),
]


def _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    return rnd(B, S, Hp, D), rnd(B, S, Hpk, D), rnd(B, S, H, D), rnd(B, S, Hk, D), rnd(B, S, Hk, D)


def _impl(op, G, kv_group):
    from flash_msa_rt.ops import dispatch

    config = dict(head_dim=128, proxy_head_dim=128, block_size=None, group=G, kv_group=kv_group, varlen=False)
    if op == "warmup_backward":
        config["deterministic"] = False
    return dispatch.implementation(op, torch.device("cuda"), torch.bfloat16, **config)


def _run(qp, kp, q, k, v, scale, go, klg):
    G, kv_group = q.shape[2] // qp.shape[2], q.shape[2] // k.shape[2]
    got_f = _impl("warmup_forward", G, kv_group)(qp, kp, q, k, v, scale)
    got_b = _impl("warmup_backward", G, kv_group)(qp, kp, q, k, v, *got_f[:3], scale, go, klg)
    return got_f, got_b


def _reference(qp, kp, q, k, v, scale, go, klg, dt):
    from flash_msa_rt import reference

    ins = [t.to(dt) for t in (qp, kp, q, k, v)]
    f = reference.warmup_forward(*ins, scale)
    return f, reference.warmup_backward(*ins, *f[:3], scale, go.to(dt), klg.to(dt))


def test_warmup_main_attention_runs_on_cudnn():
    """This machine's torch has the cuDNN operators warmup's main attention uses, and dispatch routes both warmup
    ops to the kernel backend (not the reference)."""
    from flash_msa_rt.ops import dense_main, dispatch, kernels

    assert dense_main.available() is None, dense_main.available()
    assert kernels._dense_main(torch.empty(1, 2, device="cuda"))  # (B, S): S > 1
    for op in ("warmup_forward", "warmup_backward"):
        assert _impl(op, 4, 4) is not dispatch.reference_impl(op), op


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}".format(*s))
def test_warmup_matches_reference(shape, dtype):
    _check_against_float64(shape, dtype)


def test_warmup_without_cudnn_runs_the_sparse_main_path(tuned):
    """Where torch lacks the cuDNN operators, the main attention runs on the sparse kernels with every causal
    block selected (here by tuning.warmup's override): same results."""
    from flash_msa_rt.ops import kernels

    tuned(warmup={"dense_main": False})
    assert not kernels._dense_main(torch.empty(1, device="cuda"))
    _check_against_float64((1, 700, 8, 2, 2, 1), torch.bfloat16)


def _check_against_float64(shape, dtype):
    from flash_msa_rt import tolerances

    B, S, H, Hk, Hp, Hpk = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S)
    scale = 128 ** -0.5
    g = torch.Generator(device="cuda").manual_seed(S + 1)
    go = torch.randn(q.shape, device="cuda", generator=g).to(dtype)
    klg = torch.rand(B, Hp, S, device="cuda", generator=g) + 0.5
    got_f, got_b = _run(qp, kp, q, k, v, scale, go, klg)
    (want_f, want_b) = _reference(qp, kp, q, k, v, scale, go, klg, torch.float64)
    (base_f, base_b) = _reference(qp, kp, q, k, v, scale, go, klg, torch.float32)
    for name, g_, w_, b_ in zip(NAMES, (*got_f, *got_b), (*want_f, *want_b), (*base_f, *base_b)):
        result_dtype = torch.float32 if name in ("lse", "lse_proxy", "kl_rows") else dtype
        tolerances.assert_ok(tolerances.check(name, g_, w_, b_, result_dtype=result_dtype))


def test_warmup_16k_against_float32():
    """S = 16K, configuration (a)'s head ratio at half the heads, bf16. The bf16 results (out, the five gradients)
    against the float32 reference, whose own error (~2^-24 of the terms) is far below the bf16 rounding the rule
    allows for (4x of it); the float32 statistics (lse, lse_proxy, kl_rows) on sampled rows, the last ones
    included, against those rows' float64 oracle with the float32 oracle as the baseline (float64 over all 16K rows
    would take minutes)."""
    from flash_msa_rt import tolerances
    from tests import oracle
    from tests.test_sparse_fwd_gpu import sampled_rows

    B, S, H, Hk, Hp, Hpk = 1, 16384, 8, 1, 2, 1
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=16)
    scale = 128 ** -0.5
    g = torch.Generator(device="cuda").manual_seed(17)
    go = torch.randn(q.shape, device="cuda", generator=g).to(torch.bfloat16)
    klg = torch.full((B, Hp, S), 1.0 / S, device="cuda")
    got_f, got_b = _run(qp, kp, q, k, v, scale, go, klg)
    want_f, want_b = _reference(qp, kp, q, k, v, scale, go, klg, torch.float32)
    for name, g_, w_ in zip(NAMES[:1] + NAMES[4:], (got_f[0], *got_b), (want_f[0], *want_b)):
        tolerances.assert_ok(tolerances.check(name, g_, w_, result_dtype=torch.bfloat16))
    picked = sampled_rows(S)
    exact, base = (oracle.rows(*(t.to(dt) for t in (qp, kp, q, k, v)), picked, scale)
                   for dt in (torch.float64, torch.float32))
    for name, g_ in zip(NAMES[1:4], got_f[1:]):
        tolerances.assert_ok(tolerances.check(name, g_[..., picked], getattr(exact, name), getattr(base, name),
                                              result_dtype=torch.float32))


def test_warmup_training_steps_match_the_reference():
    """A small attention layer trained in warmup mode, 10 SGD steps through flash_msa_warmup_func on CUDA:
    kernels (cuDNN main + proxy kernels; dispatch's record says so) vs the reference backend, same data; the
    float32 master weights' updates agree within tests/training.UPDATE_TOL of their own norm."""
    import flash_msa_rt
    from tests.training import assert_training_matches_reference

    assert_training_matches_reference(
        lambda qp, kp, q, k, v: flash_msa_rt.flash_msa_warmup_func(qp, kp, q, k, v, 256, 128 ** -0.5,
                                                                   layout="bshd"),
        ops=("warmup_forward", "warmup_backward"))


def test_warmup_fwd_bwd_capture_in_a_cuda_graph():
    """The warmup op's forward and backward (cuDNN + proxy kernels) are captured in one CUDA graph and replayed
    on new inputs with the results of an eager run: no host synchronisation inside."""
    B, S, H, Hk, Hp, Hpk = 1, 1000, 8, 2, 2, 1
    scale = 128 ** -0.5
    static = list(_inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=21))
    go = torch.randn(B, S, H, 128, device="cuda").to(torch.bfloat16)
    klg = torch.full((B, Hp, S), 0.5, device="cuda")
    _run(*static, scale, go, klg)  # loads the kernels and warms cuDNN up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_f, got_b = _run(*static, scale, go, klg)
    fresh = _inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=22)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    want_f, want_b = _run(*fresh, scale, go, klg)
    from tests.test_block_sparse_gpu import _same_up_to_atomics

    # The forward (cuDNN's attention, the dense KL pass: one CTA per query tile) adds without atomics: bitwise.
    # The gradients meet in fp32 atomics (the proxy backward's dk_proxy, cuDNN's dq): up to their order.
    for name, g_, w_ in zip(NAMES[:4], got_f, want_f):
        assert torch.equal(g_, w_), f"{name}: the replay differs from eager"
    for name, g_, w_ in zip(NAMES[4:], got_b, want_b):
        _same_up_to_atomics(name, g_, w_)


@pytest.mark.allow_reference
def test_deterministic_warmup_backward_runs_the_reference():
    """Warmup's backward has no deterministic kernels: under torch.use_deterministic_algorithms dispatch runs the
    reference for it on every arch (sparse mode's backward has kernels for it on sm90a), bitwise reproducible."""
    from flash_msa_rt.ops import dispatch

    config = dict(head_dim=128, proxy_head_dim=128, block_size=None, group=4, kv_group=4, varlen=False,
                  deterministic=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        impl = dispatch.implementation("warmup_backward", torch.device("cuda"), torch.bfloat16, **config)
        assert impl is dispatch.reference_impl("warmup_backward")
        qp, kp, q, k, v = _inputs(1, 300, 8, 2, 2, 1, torch.bfloat16, seed=9)
        go, klg = torch.randn_like(q), torch.full((), 0.5, device="cuda")
        f = _impl("warmup_forward", 4, 4)(qp, kp, q, k, v, 0.1)
        first, second = (impl(qp, kp, q, k, v, *f[:3], 0.1, go, klg) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
