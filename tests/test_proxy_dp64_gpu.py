"""A proxy head dim Dp = 64 below D = 128 on the kernels (issue 36): selection on its own Dp 64 variants (bf16, fp16,
fp8), the KL pass, the proxy backward and warmup's on the D kernels over the zero-padded proxy
(flash_msa_rt.ops.kernels._proxy_at), against the float64 reference with the sparse kernels' tolerance rule
(flash_msa_rt.tolerances: 4x the float32 computation's own error or the input dtype's rounding). Shapes like
configuration (b) at small S: H = 8, Hk = 2, Hp = 2 or 8, Hpk = 1, odd S not a multiple of 128. The conftest fails
any of these that falls back to the reference."""

import pytest
import torch

from flash_msa_rt.selftest import on_kernels, resolved_backends

pytestmark = pytest.mark.gpu

D, DP = 128, 64
SHAPES = [(1, 1001, 8, 2, 2, 1, 4), (2, 777, 8, 2, 8, 1, 3)]  # B, S, H, Hk, Hp, Hpk, K
NAMES = ("out", "lse", "lse_proxy", "kl_rows", "dq_proxy", "dk_proxy", "dq", "dk", "dv")


def _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    return rnd(B, S, Hp, DP), rnd(B, S, Hpk, DP), rnd(B, S, H, D), rnd(B, S, Hk, D), rnd(B, S, Hk, D)


def _impl(op, qp, q, k, **extra):
    from flash_msa_rt.ops import dispatch, kernels

    config = dict(head_dim=D, proxy_head_dim=DP, block_size=128, group=q.shape[2] // qp.shape[2],
                  kv_group=q.shape[2] // k.shape[2], varlen=False)
    config.update(extra)
    impl = dispatch.implementation(op, q.device, q.dtype, **config)
    assert impl is kernels.KERNELS.ops[op], f"{op} at Dp {DP}, D {D} does not run on the kernels"
    return impl


def _grads(q, Hp, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, S = q.shape[:2]
    return (torch.randn(q.shape, device="cuda", generator=g).to(q.dtype),
            torch.rand(B, Hp, S, device="cuda", generator=g) + 0.5)


def _check(got, want, base, dtype):
    from flash_msa_rt import tolerances

    for name, g_, w_, b_ in zip(NAMES, got, want, base, strict=True):
        assert g_.shape == w_.shape, (name, g_.shape, w_.shape)
        result_dtype = torch.float32 if name in ("lse", "lse_proxy", "kl_rows") else dtype
        tolerances.assert_ok(tolerances.check(name, g_, w_, b_, result_dtype=result_dtype))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_selection_at_dp64_equals_the_reference(dtype, precision):
    """The Dp 64 selection kernel (on the public API's route) against the reference's selection of the same
    precision, row for row: rows may differ at near ties only (fp32 sums in another order; for fp8, Hopper's fp8
    MMA's coarser sums, as tests/test_select_fp8_gpu.py allows)."""
    from flash_msa_rt.reference.selection import select_blocks

    B, S, Hp, Hpk, K = 1, 3001, 8, 1, 8
    qp, kp, q, k, _ = _inputs(B, S, 8, 2, Hp, Hpk, dtype, seed=3)
    scale = DP ** -0.5
    sel = _impl("select_blocks", qp, q, k, top_k_blocks=K, select_precision=precision)(qp, kp, K, 128, scale,
                                                                                       precision=precision)
    ref = select_blocks(qp, kp, K, 128, scale, precision)
    rows_equal = (sel == ref).all(-1).double().mean().item()
    assert rows_equal >= 0.995, rows_equal


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}_K{}".format(*s))
def test_msa_forward_backward_at_dp64(shape, dtype):
    """Forward (out, lse, lse_proxy, kl_rows), the deferred KL pass and the backward's five gradients through the
    kernel backend at Dp 64 < D, on the kernel's own selection, against the reference at Dp 64; the proxy
    gradients come back Dp wide and contiguous, and the deferred KL pass gives the forward's lse_proxy and kl_rows
    (the same KL kernels on the same inputs; the forward may cut its work in other chunks)."""
    from flash_msa_rt import reference

    B, S, H, Hk, Hp, Hpk, K = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S)
    scale = D ** -0.5
    sel = _impl("select_blocks", qp, q, k, top_k_blocks=K)(qp, kp, K, 128, scale)
    go, klg = _grads(q, Hp, S + 1)
    fwd = _impl("msa_forward", qp, q, k)(qp, kp, q, k, v, sel, 128, scale)
    kl_pass = _impl("msa_kl", qp, q, k)(qp, kp, q, k, v, fwd[1], sel, 128, scale)
    for a, b in zip(kl_pass, fwd[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    bwd = _impl("msa_backward", qp, q, k, deterministic=False)(qp, kp, q, k, v, *fwd[:3], sel, 128, scale, go, klg)
    assert bwd[0].shape == qp.shape and bwd[1].shape == kp.shape
    assert bwd[0].is_contiguous() and bwd[1].is_contiguous()
    torch.cuda.synchronize()

    def ref(dt):
        ins = [t.to(dt) for t in (qp, kp, q, k, v)]
        f = reference.msa_forward(*ins, sel, 128, scale)
        return (*f, *reference.msa_backward(*ins, *f[:3], sel, 128, scale, go.to(dt), klg.to(dt)))

    _check((*fwd, *bwd), ref(torch.float64), ref(torch.float32), dtype)


@pytest.mark.parametrize("dense_main", [True, False], ids=["cudnn-main", "sparse-main"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}_K{}".format(*s))
def test_warmup_at_dp64(shape, dense_main, tuned):
    """Warmup forward, KL pass and backward at Dp 64 < D: the proxy's passes on the dense warmup kernels (or the
    sparse ones where those are not built) over the padded proxy, the main attention on cuDNN or on the sparse
    kernels, against the reference warmup at Dp 64."""
    from flash_msa_rt import reference

    if not dense_main:
        tuned(warmup={"dense_main": False})
    B, S, H, Hk, Hp, Hpk, _ = shape
    dtype = torch.bfloat16
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S + 5)
    scale = D ** -0.5
    go, klg = _grads(q, Hp, S + 6)
    fwd = _impl("warmup_forward", qp, q, k, block_size=None)(qp, kp, q, k, v, scale)
    kl_pass = _impl("warmup_kl", qp, q, k, block_size=None)(qp, kp, q, k, v, fwd[1], scale)
    for a, b in zip(kl_pass, fwd[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    bwd = _impl("warmup_backward", qp, q, k, block_size=None, deterministic=False)(qp, kp, q, k, v, *fwd[:3], scale,
                                                                                    go, klg)
    assert bwd[0].shape == qp.shape and bwd[1].shape == kp.shape
    torch.cuda.synchronize()

    def ref(dt):
        ins = [t.to(dt) for t in (qp, kp, q, k, v)]
        f = reference.warmup_forward(*ins, scale)
        return (*f, *reference.warmup_backward(*ins, *f[:3], scale, go.to(dt), klg.to(dt)))

    _check((*fwd, *bwd), ref(torch.float64), ref(torch.float32), dtype)


@pytest.mark.parametrize("entry, select_precision", [
    ("flash_msa_func", "bf16"), ("flash_msa_func", "fp8"), ("flash_msa_warmup_func", None)])  # warmup selects nothing
def test_public_api_at_dp64_exact_and_deferred(entry, select_precision, tuned):
    """flash_msa_func / flash_msa_warmup_func with (B, H, S, Dp 64) proxies: every op on the kernels; the deferred
    KL value (the backward's KL pass) equals the exact one, and the gradients agree across the two modes up to
    the atomics' order. MSA's output and KL equal the reference's on the kernel's selection. The backward's KL pass
    is the one under test, so a small sparse step keeps it there (tuning.kl_value would move it to the forward)."""
    import flash_msa_rt as F
    from flash_msa_rt import reference

    B, S, H, Hk, Hp, Hpk, top_k = 1, 2049, 8, 2, 2, 1, 512
    ins = [t.transpose(1, 2).contiguous() for t in _inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=11)]
    dout = torch.randn(B, S, H * D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(12))
    extra = {"select_precision": select_precision} if entry == "flash_msa_func" else {}
    fn = getattr(F, entry)
    tuned(kl_value={"forward_pass_rows": 0})
    runs = {}
    for kl_value in ("exact", "deferred"):
        leaves = [t.clone().requires_grad_() for t in ins]
        metric = torch.zeros((), device="cuda")
        with resolved_backends() as seen:
            out, kl = fn(*leaves, top_k, kl_metric=metric, kl_value=kl_value, **extra)
            forward_kl = kl.detach().clone()
            ((out.float() * dout).sum() + 0.3 * kl).backward()
        torch.cuda.synchronize()
        forward_op = "msa_forward" if entry == "flash_msa_func" else "warmup_forward"
        ops = (forward_op, forward_op.replace("forward", "backward"))
        ops += (("select_blocks",) if entry == "flash_msa_func" else ()) + \
            ((forward_op.replace("forward", "kl"),) if kl_value == "deferred" else ())
        assert on_kernels(seen, ops) is None, seen
        runs[kl_value] = (out.detach(), forward_kl, metric, [t.grad for t in leaves])
    (out, exact_kl, _, exact_grads), (_, deferred_kl, deferred_metric, deferred_grads) = runs.values()
    assert float(deferred_kl) == 0 and float(exact_kl) > 0
    assert abs(float(deferred_metric) - float(exact_kl)) <= 1e-3 * abs(float(exact_kl))
    for name, e, d in zip(("q_proxy", "k_proxy", "q", "k", "v"), exact_grads, deferred_grads):
        assert e.shape == d.shape == ins[("q_proxy", "k_proxy", "q", "k", "v").index(name)].shape, name
        torch.testing.assert_close(d.float(), e.float(), rtol=2e-2, atol=2e-2 * e.float().abs().max())
    if entry == "flash_msa_func":
        sel = F.select_blocks(ins[0], ins[1], top_k, D ** -0.5, select_precision=select_precision)
        t = [x.transpose(1, 2).double() for x in ins]
        want_out, _, _, want_rows = reference.msa_forward(*t, sel, 128, D ** -0.5)
        torch.testing.assert_close(out.double(), want_out.reshape(B, S, H * D), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(exact_kl.double(), want_rows.mean(), rtol=1e-3, atol=1e-6)


def test_dp64_fwd_bwd_capture_in_a_cuda_graph():
    """The padding allocates and copies on the device only: selection, forward (with its KL pass) and backward at
    Dp 64 capture into one CUDA graph, and the replay on new inputs gives eager's out and kl_rows bitwise and its
    gradients up to the atomics' order."""
    from tests.test_block_sparse_gpu import _same_up_to_atomics

    qp, kp, q, k, v = _inputs(1, 1500, 8, 2, 2, 1, torch.bfloat16, seed=21)
    scale = D ** -0.5
    go, klg = _grads(q, 2, 22)
    select, fwd, bwd = (_impl(op, qp, q, k, **extra) for op, extra in (
        ("select_blocks", {"top_k_blocks": 4}), ("msa_forward", {}), ("msa_backward", {"deterministic": False})))

    def step():
        sel = select(qp, kp, 4, 128, scale)
        out, lse, lse_p, kl_rows = fwd(qp, kp, q, k, v, sel, 128, scale)
        return (out, kl_rows, *bwd(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, go, klg))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    qp.copy_(qp.flip(1))
    q.copy_(q.flip(1))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for name, a, b in zip(("out", "kl_rows"), static[:2], eager[:2]):
        assert torch.equal(a, b), f"{name}: the replay differs from eager"
    for name, a, b in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), static[2:], eager[2:]):
        _same_up_to_atomics(name, a, b)
