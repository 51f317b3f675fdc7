"""Every (D, Dp, Bs) point of the contract's matrix that the kernels serve, against the float64 reference with the
kernels' tolerance rule (flash_msa_rt.tolerances: a small multiple of the float32 computation's own error or the
input dtype's rounding): selection, the forward (out, lse, lse_proxy, kl_rows), the deferred KL pass, the backward's
five gradients (atomic and deterministic, bitwise across runs), warmup, block-sparse attention, packed sequences
and a CUDA graph. Shapes like configuration (b) at small odd S (not a multiple of either block size), at G = 4 and
G = 1. The conftest fails any of these that falls back to the reference; the points the kernels do not serve must
be declined with the build command or the measured limit (test_unserved_points_are_declined_with_the_reason)."""

import pytest
import torch

from flash_msa_rt.selftest import on_kernels, resolved_backends
from tests.test_proxy_dp64_gpu import _grads  # upstream gradients (dout, kl_grad) of a test

pytestmark = pytest.mark.gpu

# (D, Dp, Bs): the built matrix of the default and on-request builds (kernels_src/matrix.py)
POINTS = [(64, 64, 128), (64, 64, 64), (128, 64, 64), (128, 128, 64), (128, 128, 128), (256, 128, 64),
          (256, 128, 128), (256, 64, 128)]  # D 256: 64-key kernel blocks (a selection of 128 split in halves)
SHAPES = [(1, 1001, 8, 2, 2, 1, 4), (2, 777, 8, 2, 8, 1, 3)]  # B, S, H, Hk, Hp, Hpk, K
NAMES = ("out", "lse", "lse_proxy", "kl_rows", "dq_proxy", "dk_proxy", "dq", "dk", "dv")


def _pid(p):
    return "D{}_Dp{}_Bs{}".format(*p)


def _sid(s):
    return "B{}_S{}_H{}_Hk{}_Hp{}_Hpk{}_K{}".format(*s)


def _inputs(B, S, H, Hk, Hp, Hpk, D, Dp, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    return rnd(B, S, Hp, Dp), rnd(B, S, Hpk, Dp), rnd(B, S, H, D), rnd(B, S, Hk, D), rnd(B, S, Hk, D)


def _impl(op, qp, q, k, Bs, **extra):
    from flash_msa_rt.ops import dispatch, kernels

    config = dict(head_dim=q.shape[3], proxy_head_dim=qp.shape[3], block_size=Bs, group=q.shape[2] // qp.shape[2],
                  kv_group=q.shape[2] // k.shape[2], varlen=False)
    config.update(extra)
    impl = dispatch.implementation(op, q.device, q.dtype, **config)
    assert impl is kernels.KERNELS.ops[op], f"{op} at {config} does not run on the kernels"
    return impl


def _check(got, want, base, dtype, names=NAMES):
    from flash_msa_rt import tolerances

    for name, g_, w_, b_ in zip(names, got, want, base, strict=True):
        assert g_.shape == w_.shape, (name, g_.shape, w_.shape)
        result_dtype = torch.float32 if name in ("lse", "lse_proxy", "kl_rows") else dtype
        tolerances.assert_ok(tolerances.check(name, g_, w_, b_, result_dtype=result_dtype))


def _check_msa(got, ins, sel, Bs, scale, go, klg, dtype):
    """An MSA forward + backward on the kernels against the reference on the same selection, in float64 (the
    truth) with float32 as the yardstick of the tolerance rule."""
    from flash_msa_rt import reference

    def ref(dt):
        x = [t.to(dt) for t in ins]
        f = reference.msa_forward(*x, sel, Bs, scale)
        return (*f, *reference.msa_backward(*x, *f[:3], sel, Bs, scale, go.to(dt), klg.to(dt)))

    _check(got, ref(torch.float64), ref(torch.float32), dtype)


def _selected(point, shape, dtype, seed, grad_seed):
    """Inputs at (D, Dp, Bs) point and shape, the kernels' selection of them and upstream gradients: (ins, sel,
    scale, go, klg)."""
    D, Dp, Bs = point
    B, S, H, Hk, Hp, Hpk, K = shape
    ins = _inputs(B, S, H, Hk, Hp, Hpk, D, Dp, dtype, seed=seed)
    qp, kp, q, k, _ = ins
    scale = D ** -0.5
    sel = _impl("select_blocks", qp, q, k, Bs, top_k_blocks=K)(qp, kp, K, Bs, scale)
    return (ins, sel, scale, *_grads(q, Hp, grad_seed))


def _msa_step(ins, sel, Bs, scale, go, klg, deterministic=False):
    qp, kp, q, k, v = ins
    fwd = _impl("msa_forward", qp, q, k, Bs)(qp, kp, q, k, v, sel, Bs, scale)
    bwd = _impl("msa_backward", qp, q, k, Bs, deterministic=deterministic)(qp, kp, q, k, v, *fwd[:3], sel, Bs, scale,
                                                                          go, klg)
    return fwd, bwd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
@pytest.mark.parametrize("point", POINTS, ids=_pid)
def test_msa_forward_kl_backward(point, shape, dtype):
    """Selection, forward, the deferred KL pass (equal to the forward's) and the atomic backward on the kernels,
    against the reference on the kernel's selection; the selection row for row against the reference's (near ties
    aside)."""
    from flash_msa_rt.reference.selection import select_blocks

    D, Dp, Bs = point
    S, K = shape[1], shape[6]
    ins, sel, scale, go, klg = _selected(point, shape, dtype, S + D + Bs, S + 1)
    qp, kp, q, k, v = ins
    rows_equal = (sel == select_blocks(qp, kp, K, Bs, scale)).all(-1).double().mean().item()
    assert rows_equal >= 0.99, rows_equal
    fwd, bwd = _msa_step(ins, sel, Bs, scale, go, klg)
    kl_pass = _impl("msa_kl", qp, q, k, Bs)(qp, kp, q, k, v, fwd[1], sel, Bs, scale)
    for a, b in zip(kl_pass, fwd[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert bwd[0].shape == qp.shape and bwd[1].shape == kp.shape
    torch.cuda.synchronize()
    _check_msa((*fwd, *bwd), ins, sel, Bs, scale, go, klg, dtype)


@pytest.mark.parametrize("point", POINTS, ids=_pid)
def test_deterministic_backward_is_bitwise_and_exact(point):
    """Under torch.use_deterministic_algorithms the backward runs its deterministic kernels: two runs give the same
    bits, and they equal the reference within the tolerance rule."""
    D, Dp, Bs = point
    dtype = torch.bfloat16
    ins, sel, scale, go, klg = _selected(point, SHAPES[1], dtype, 7 + D, 8)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_msa_step(ins, sel, Bs, scale, go, klg, deterministic=True) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)
    fwd, bwd = runs[0]
    _check_msa((*fwd, *bwd), ins, sel, Bs, scale, go, klg, dtype)


@pytest.mark.parametrize("point", [p for p in POINTS if p[2] == 128], ids=_pid)
def test_warmup(point):
    """Warmup forward, KL pass and backward: cuDNN's main attention at D, the proxy's passes on the dense warmup
    kernels at D (the proxy zero-padded where Dp < D)."""
    from flash_msa_rt import reference

    D, Dp, _ = point
    B, S, H, Hk, Hp, Hpk, _ = SHAPES[0]
    dtype = torch.bfloat16
    ins = _inputs(B, S, H, Hk, Hp, Hpk, D, Dp, dtype, seed=D + 5)
    qp, kp, q, k, v = ins
    scale = D ** -0.5
    go, klg = _grads(q, Hp, 6)
    fwd = _impl("warmup_forward", qp, q, k, None)(qp, kp, q, k, v, scale)
    bwd = _impl("warmup_backward", qp, q, k, None, deterministic=False)(qp, kp, q, k, v, *fwd[:3], scale, go, klg)
    torch.cuda.synchronize()

    def ref(dt):
        x = [t.to(dt) for t in ins]
        f = reference.warmup_forward(*x, scale)
        return (*f, *reference.warmup_backward(*x, *f[:3], scale, go.to(dt), klg.to(dt)))

    _check((*fwd, *bwd), ref(torch.float64), ref(torch.float32), dtype)


@pytest.mark.parametrize("point", POINTS, ids=_pid)
def test_public_api_exact_deferred_packed(point):
    """flash_msa_func through the public API (bhsd), every op on the kernels: exact and deferred KL give the same
    value (kl_metric) and gradients up to the atomics' order; a packed batch of two documents equals each document
    run alone."""
    import flash_msa_rt as F

    D, Dp, Bs = point
    B, S, H, Hk, Hp, Hpk, _ = 1, 2 * Bs * 5 + 37, 8, 2, 2, 1, 0
    top_k = 4 * Bs
    ins = [t.transpose(1, 2).contiguous() for t in _inputs(B, S, H, Hk, Hp, Hpk, D, Dp, torch.bfloat16, seed=11)]
    dout = torch.randn(B, S, H * D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(12))
    runs = {}
    for kl_value in ("exact", "deferred"):
        leaves = [t.clone().requires_grad_() for t in ins]
        metric = torch.zeros((), device="cuda")
        with resolved_backends() as seen:
            out, kl = F.flash_msa_func(*leaves, top_k, kl_metric=metric, kl_value=kl_value, block_size=Bs)
            ((out.float() * dout).sum() + 0.3 * kl).backward()
        torch.cuda.synchronize()
        assert on_kernels(seen, ("select_blocks", "msa_forward", "msa_backward")) is None, seen
        runs[kl_value] = (out.detach(), metric.clone(), [t.grad for t in leaves])
    (out_e, kl_e, grads_e), (out_d, kl_d, grads_d) = runs.values()
    assert torch.equal(out_e, out_d)
    assert abs(float(kl_d) - float(kl_e)) <= 1e-3 * abs(float(kl_e))
    for e, d in zip(grads_e, grads_d):
        torch.testing.assert_close(d.float(), e.float(), rtol=2e-2, atol=2e-2 * e.float().abs().max())

    # packed: documents [0, a) and [a, S) of one row, each equal to its own call
    a = 3 * Bs + 11
    cu = torch.tensor([0, a, S], dtype=torch.int32, device="cuda")
    out_p, _ = F.flash_msa_func(*ins, top_k, cu_seqlens=cu, block_size=Bs)
    for s0, s1 in ((0, a), (a, S)):
        part = [t[:, :, s0:s1].contiguous() for t in ins]
        out_1, _ = F.flash_msa_func(*part, top_k, block_size=Bs)
        torch.testing.assert_close(out_p[:, s0:s1].float(), out_1.float(), rtol=1e-2, atol=1e-2)


BLOCK_SPARSE_CASES = [(p, None) for p in [(64, 64, 64), (128, 128, 64), (64, 64, 128), (256, 256, 64),
                                           (256, 256, 128)]] + [((256, 256, 64), "sync"), ((256, 256, 128), "sync")]


@pytest.mark.parametrize("point, mma", BLOCK_SPARSE_CASES,
                         ids=[_pid(p) + (f"-{m}" if m else "") for p, m in BLOCK_SPARSE_CASES])
def test_block_sparse_attention(point, mma, force_mma, launched_kernels):
    """block_sparse_attention over given indices (NSA's selected attention: 16 query heads, 2 KV groups), forward
    and backward, against the reference; at D 256 also on the mma.sync kernels (sm100a's)."""
    import flash_msa_rt as F
    if mma:
        force_mma(mma)
    D, _, Bs = point
    B, H, Hk, S, K = 1, 16, 2, 901, 5
    g = torch.Generator(device="cuda").manual_seed(D + Bs)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", generator=g).to(torch.bfloat16) for h in (H, Hk, Hk))
    nb = -(-S // Bs)
    i = torch.arange(S, device="cuda") // Bs
    idx = torch.stack([torch.minimum(i, (i * (j + 3) // 7 + j) % nb) for j in range(K)], -1)
    idx = torch.where(idx <= i[:, None], idx, i[:, None]).to(torch.int32).view(1, 1, S, K).expand(B, Hk, S, K)
    idx = idx.contiguous()
    dout = torch.randn(B, H, S, D, device="cuda", generator=g).to(torch.bfloat16)

    def run(dt, device):
        leaves = [t.to(device=device, dtype=dt).clone().requires_grad_() for t in (q, k, v)]
        out = F.block_sparse_attention(*leaves, idx.to(device), block_size=Bs)
        (out.float() * dout.to(device).float()).sum().backward()
        return tuple(t.detach().cpu() for t in (out, *(x.grad for x in leaves)))

    with resolved_backends() as seen:
        got = run(torch.bfloat16, "cuda")
    assert on_kernels(seen, ("block_sparse_forward", "block_sparse_backward")) is None, seen
    if mma:
        main_kernels = [n for n in launched_kernels if n.startswith(("sparse_fwd", "sparse_bwd"))]
        assert main_kernels and all(f"mma{mma}" in n for n in main_kernels), main_kernels
    want, base = run(torch.float64, "cpu"), run(torch.float32, "cpu")  # the reference
    _check(got, want, base, torch.bfloat16, names=("out", "dq", "dk", "dv"))


@pytest.mark.parametrize("point", [(64, 64, 64), (256, 128, 128)], ids=_pid)
def test_cuda_graph(point):
    """Selection, forward and backward (at D 256 with the selection's split into 64-key blocks) capture into one
    CUDA graph; the replay on new inputs gives eager's out and kl_rows bitwise."""
    D, Dp, Bs = point
    ins = _inputs(1, 1500, 8, 2, 2, 1, D, Dp, torch.bfloat16, seed=21)
    qp, kp, q, k, v = ins
    scale = D ** -0.5
    go, klg = _grads(q, 2, 22)
    select = _impl("select_blocks", qp, q, k, Bs, top_k_blocks=6)
    fwd = _impl("msa_forward", qp, q, k, Bs)
    bwd = _impl("msa_backward", qp, q, k, Bs, deterministic=False)

    def step():
        sel = select(qp, kp, 6, Bs, scale)
        out, lse, lse_p, kl_rows = fwd(qp, kp, q, k, v, sel, Bs, scale)
        return (out, kl_rows, *bwd(qp, kp, q, k, v, out, lse, lse_p, sel, Bs, scale, go, klg))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = _inputs(1, 1500, 8, 2, 2, 1, D, Dp, torch.bfloat16, seed=23)
    for t, f in zip(ins, fresh):
        t.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    for c, e in zip(captured[2:], eager[2:]):
        torch.testing.assert_close(c.float(), e.float(), rtol=1e-2, atol=1e-2 * e.float().abs().max())


@pytest.mark.allow_reference
@pytest.mark.parametrize("D, Dp", [(64, 128)])
def test_unserved_points_are_declined_with_the_reason(D, Dp):
    """A point the kernels do not serve is declined with a reason that says what is built (dispatch then names the
    build command) and still computes the right answer on the reference."""
    from flash_msa_rt.ops import kernels
    from flash_msa_rt.ops.backends import Problem

    reason = kernels.KERNELS.supports(Problem(
        "msa_forward", torch.device("cuda"), torch.bfloat16,
        dict(head_dim=D, proxy_head_dim=Dp, block_size=128, group=4, kv_group=4, varlen=False)))
    assert reason and f"D {D}" in reason and f"Dp {Dp}" in reason, reason


SYNC_CASES = [(p, SHAPES[0]) for p in POINTS if p != (128, 128, 128)] + [
    ((256, 128, 128), (1, 333, 16, 2, 2, 1, 3)), ((256, 128, 128), (1, 333, 16, 1, 1, 1, 3))]  # D 256 at G 8, 16


@pytest.mark.parametrize("point, shape", SYNC_CASES, ids=[f"{_pid(p)}-{_sid(s)}" for p, s in SYNC_CASES])
def test_mma_sync_kernels_sm100a_runs(point, shape, force_mma, launched_kernels):
    """The mma.sync builds (what sm100a launches; hopper_sync_check on sm90a) at every new point, D 256 (dQ and O in
    column pieces) at G 4, 8 and 16 too: forward, KL pass and backward against the reference, and no wgmma variant
    launched."""
    force_mma("sync")
    D, Dp, Bs = point
    dtype = torch.bfloat16
    ins, sel, scale, go, klg = _selected(point, shape, dtype, 31 + D + Bs, 32)
    fwd, bwd = _msa_step(ins, sel, Bs, scale, go, klg)
    torch.cuda.synchronize()
    main_kernels = [n for n in launched_kernels if n.startswith(("sparse_fwd", "sparse_kl", "sparse_bwd"))]
    assert main_kernels and all("mmasync" in n for n in main_kernels), main_kernels
    _check_msa((*fwd, *bwd), ins, sel, Bs, scale, go, klg, dtype)


@pytest.mark.parametrize("shape", [(1, 333, 16, 2, 2, 1, 3), (1, 333, 16, 1, 1, 1, 3)], ids=["G8", "G16"])
def test_d256_wide_groups(shape):
    """D 256 at G = 8 and 16 (the KL pass's stepped heads, the backward without the producer warpgroup): forward, KL
    and atomic backward against the reference, and the deterministic backward bitwise across two runs."""
    Bs = 128
    ins, sel, scale, go, klg = _selected((256, 128, Bs), shape, torch.bfloat16, 41 + shape[4], 42)
    fwd, bwd = _msa_step(ins, sel, Bs, scale, go, klg)
    torch.cuda.synchronize()
    _check_msa((*fwd, *bwd), ins, sel, Bs, scale, go, klg, torch.bfloat16)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_msa_step(ins, sel, Bs, scale, go, klg, deterministic=True)[1] for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
