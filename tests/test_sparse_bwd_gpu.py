"""The MSA sparse backward kernels (sparse_bwd + sparse_bwd_proxy) on the GPU, against the reference backward on
the kernel's own block_indices (msa-semantics.md), on fresh random inputs; plus a short training run and a
captured forward + backward.

Tolerance (flash_msa_rt.tolerances, the GPU suite's one rule): the kernel may cost 4x what the input dtype costs
the same backward: the float32 reference's error against float64, or rounding the float64 gradient to the input
dtype, whichever is larger, plus 1e-5 of the gradient's scale (the kernel, like FlashAttention, also rounds P and
dS to the input dtype before their products). Results made without atomics must match bitwise.
"""

import contextlib

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [  # B, S, H, Hk, Hp, Hpk, K
    (1, 1, 4, 1, 1, 1, 1),
    (1, 300, 4, 1, 1, 1, 3),
    (2, 1000, 16, 2, 4, 1, 4),
    (1, 777, 8, 8, 8, 2, 16),
    (1, 2049, 16, 1, 1, 1, 8),
    (1, 1500, 8, 2, 4, 4, 5),
    (1, 3000, 16, 2, 2, 1, 16),
]


def _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    return rnd(B, S, Hp, D), rnd(B, S, Hpk, D), rnd(B, S, H, D), rnd(B, S, Hk, D), rnd(B, S, Hk, D)


def _check_backward(qp, kp, q, k, v, sel, scale, seed=0, deterministic=False, repeat=False):
    """The kernels' five gradients against the reference's; deterministic: the deterministic kernels, and with
    repeat a second backward on the same inputs must give bitwise-identical gradients."""
    from flash_msa_rt import reference
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt import tolerances
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    B, S, H, D = q.shape
    Hp = qp.shape[2]
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    grad_out = torch.randn(B, S, H, D, device="cuda", generator=g).to(q.dtype)
    kl_grad = torch.rand(B, Hp, S, device="cuda", generator=g) + 0.5
    out, lse, lse_p, _ = msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    got = msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, grad_out, kl_grad, deterministic)
    if repeat:
        again = msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, grad_out, kl_grad, deterministic)
        for name, a, b in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), got, again):
            assert torch.equal(a, b), f"{name}: two deterministic backward passes differ"
    torch.cuda.synchronize()

    def ref(dt):
        ins = [t.to(dt) for t in (qp, kp, q, k, v)]
        o, l, lp, _ = reference.msa_forward(*ins, sel, 128, scale)
        return reference.msa_backward(*ins, o, l, lp, sel, 128, scale, grad_out.to(dt), kl_grad.to(dt))

    want, base = ref(torch.float64), ref(torch.float32)
    for name, g_, w_, b_ in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), got, want, base):
        assert g_.dtype == q.dtype and g_.shape == w_.shape, name
        tolerances.assert_ok(tolerances.check(name, g_, w_, b_))
    return got


def _selection(qp, kp, K, scale):
    from flash_msa_rt.ops.select import select_blocks_cuda

    return select_blocks_cuda(qp, kp, K, 128, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_reference(shape, dtype):
    B, S, H, Hk, Hp, Hpk, K = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S + H)
    scale = 128 ** -0.5
    _check_backward(qp, kp, q, k, v, _selection(qp, kp, K, scale), scale)


@pytest.mark.parametrize("mma,heads", [("sync", "stepped"), ("wgmma", "stepped"), ("wgmma", "resident"),
                                       ("wgmma", "tau")])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_both_backward_kernels_match_reference(mma, heads, G, force_mma, tuned):
    """Hopper builds the KL pass and both backward kernels twice (mma.sync, and wgmma which the runtime picks
    there), and the proxy backward on wgmma three ways (tau read from the main backward, the runtime's choice with
    both gradients; tau recomputed with heads stepped, or resident at G <= 4, as when only kl_grad arrives): all
    are checked, on odd S, whatever the device's default."""
    from flash_msa_rt.ops import sparse_bwd

    force_mma(mma)
    if heads != "tau":  # tau recomputed by the proxy kernel; resident heads exist up to G = 4
        tuned(sparse_bwd={"tau_path": False, "recompute_heads": heads if G <= 4 else "stepped"})
    t = sparse_bwd.choice("sm90a", G)
    assert (t.mma, t.proxy_mma, t.tau_path) == (mma, mma, mma == "wgmma" and heads == "tau")
    H = 16
    qp, kp, q, k, v = _inputs(1, 1500, H, 1, H // G, 1, torch.bfloat16, seed=G + 40)
    scale = 128 ** -0.5
    _check_backward(qp, kp, q, k, v, _selection(qp, kp, 6, scale), scale)


@pytest.mark.parametrize("producer", [False, True])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_main_backward_with_and_without_producer(G, producer, tuned):
    """At G <= 4 the main kernel runs warp-specialised (a producer warpgroup gathers the tiles:
    kernels_src/sparse_bwd/producer.py); the kernel without one is still built: both match the reference on odd
    S with several tiles per item and items of several lists."""
    from flash_msa_rt.ops import sparse_bwd
    from flash_msa_rt.ops.device import arch_of

    if sparse_bwd.choice(arch_of(torch.device("cuda")), G).mma != "wgmma":
        pytest.skip("the producer variant is the wgmma tau kernel (sm90a)")
    tuned(sparse_bwd={"producer": producer})
    t = sparse_bwd.choice("sm90a", G)
    assert (sparse_bwd.kernel_config("bf16", 128, 128, G, t, True)["threads"] == 384) == producer
    H = 8
    qp, kp, q, k, v = _inputs(2, 2333, H, 2, H // G, 1, torch.bfloat16, seed=G + 70)
    scale = 128 ** -0.5
    _check_backward(qp, kp, q, k, v, _selection(qp, kp, 7, scale), scale)


@pytest.mark.parametrize("order,bin_queries", [("list", 0), ("size", 0), ("query", 0), ("bins", 256), ("bins", 1000)])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_backward_in_every_item_order(G, order, bin_queries, tuned):
    """The backward's items in each order chunk_plans makes (the same entries, other items and CTAs' order; "bins"
    cuts the lists at query bins, here several per sequence and one not a multiple of the block) give the
    reference's gradients, in head and query chunks as well."""
    from flash_msa_rt.ops import sparse_bwd

    bins = {"bin_queries": bin_queries} if bin_queries else {}
    tuned(sparse_bwd={"item_order": order, **bins, "tau_budget": 1 << 22},
          sparse_fwd={"item_order": order, **bins})  # the forward's lse, which the gradients need, as well
    assert sparse_bwd.choice("sm90a", G).item_order == order
    H = 16
    Hp = H // G
    # Hk <= Hp: the kernels take a proxy group within one KV head (at G = 16 one proxy head, so one KV head)
    qp, kp, q, k, v = _inputs(2, 2500, H, min(2, Hp), Hp, 1, torch.bfloat16, seed=G + 90)
    scale = 128 ** -0.5
    _check_backward(qp, kp, q, k, v, _selection(qp, kp, 6, scale), scale)


@pytest.mark.parametrize("heads_per_chunk", [0, 2])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_tau_path_in_chunks(G, heads_per_chunk, tuned):
    """With tau passed from the main kernel to the proxy kernel the backward runs per chunk of proxy heads, and of
    queries where one head's tau rows exceed the budget: two heads per chunk (head-sliced views, KV and proxy-key
    heads shared across chunks), or one head and one block of queries per chunk (an odd S, an offset last chunk)
    give the reference's gradients too."""
    from flash_msa_rt.ops import sparse_bwd
    from flash_msa_rt.ops.device import arch_of

    if not sparse_bwd.choice(arch_of(torch.device("cuda")), G).tau_path:
        pytest.skip("the tau path runs on wgmma (sm90a)")
    S, Hp, K = 1100, 16 // G, 5
    Hk = min(2, Hp)
    budget = max(1, heads_per_chunk * S * K * 128 * 2)
    tuned(sparse_bwd={"tau_budget": budget})
    assert sparse_bwd.choice("sm90a", G, 128, 128, 1, S, 16).tau_budget == budget
    c = sparse_bwd.tau_heads(1, S, Hp, Hk, 1, K, 128, budget)
    assert c == (min(Hp, heads_per_chunk) or 1)
    assert (sparse_bwd.tau_chunk(1, S, c, K, 128, budget) == 128) == (heads_per_chunk == 0)
    qp, kp, q, k, v = _inputs(1, S, 16, Hk, Hp, 1, torch.bfloat16, seed=70 + G + heads_per_chunk)
    scale = 128 ** -0.5
    _check_backward(qp, kp, q, k, v, _selection(qp, kp, K, scale), scale)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_skewed_selection(deterministic):
    """Every query keeps block 0: block 0's list spans all queries, cut into many items that meet in atomics (or,
    deterministic, in the fixed-order item sums)."""
    B, S, H, Hk, Hp, Hpk, K = 1, 3000, 8, 2, 2, 1, 4
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=12)
    i = torch.arange(S, device="cuda")
    local = i // 128
    sel = torch.stack([torch.zeros_like(local), local - 2, local - 1, local], -1)
    for s in range(1, K):  # blocks below 0 or repeating an earlier slot: empty
        rep = (sel[:, s:s + 1] == sel[:, :s]).any(-1) | (sel[:, s] < 0)
        sel[:, s] = torch.where(rep, torch.full_like(sel[:, s], -1), sel[:, s])
    sel = sel.to(torch.int32).view(1, 1, S, K).expand(B, Hp, S, K).contiguous()
    if deterministic:
        _skip_without_deterministic_kernels()
    _check_backward(qp, kp, q, k, v, sel, 128 ** -0.5, deterministic=deterministic, repeat=deterministic)


def _skip_without_deterministic_kernels():
    from flash_msa_rt.loader import device_arch
    from flash_msa_rt.ops import sparse_bwd

    why = sparse_bwd.deterministic_refusal(device_arch(torch.cuda.current_device()))
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("heads_per_chunk", [0, 2])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_deterministic_backward_matches_reference_and_repeats(G, heads_per_chunk, tuned):
    """The deterministic kernels (partial rows stored, summed in plan order) give the reference's gradients and
    the same bits twice, in one chunk, in chunks of two proxy heads (KV and proxy-key heads shared across chunks),
    and in chunks of one head and one block of queries (an odd S, an offset last chunk)."""
    from flash_msa_rt.ops import sparse_bwd

    _skip_without_deterministic_kernels()
    S, Hp, K = 1100, 16 // G, 5
    Hk = min(2, Hp)
    per_entry = sparse_bwd.entry_bytes(128, G, 128, True)
    budget = heads_per_chunk * S * K * per_entry or 1
    tuned(sparse_bwd={"deterministic_budget": budget})
    assert sparse_bwd.choice("sm90a", G, 128, 128, 1, S, 16).deterministic_budget == budget
    c = sparse_bwd.tau_heads(1, S, Hp, Hk, 1, K, 128, budget, per_entry)
    assert c == (min(Hp, heads_per_chunk) or 1)
    assert (sparse_bwd.tau_chunk(1, S, c, K, 128, budget, per_entry) == 128) == (heads_per_chunk == 0)
    qp, kp, q, k, v = _inputs(1, S, 16, Hk, Hp, 1, torch.bfloat16, seed=90 + G + heads_per_chunk)
    scale = 128 ** -0.5
    sel = _selection(qp, kp, K, scale)
    assert torch.utils.deterministic.fill_uninitialized_memory
    # Under deterministic algorithms torch fills every torch.empty with NaN: a partial row the kernels did not
    # write, and the sums then read, would show (compute-sanitizer's initcheck does not see their bulk stores).
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _check_backward(qp, kp, q, k, v, sel, scale, deterministic=True, repeat=True)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_deterministic_backward_in_one_chunk(shape, dtype):
    """The deterministic kernels on the shapes of test_backward_matches_reference, at the runtime's budget."""
    _skip_without_deterministic_kernels()
    B, S, H, Hk, Hp, Hpk, K = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S + H + 5)
    scale = 128 ** -0.5
    _check_backward(qp, kp, q, k, v, _selection(qp, kp, K, scale), scale, deterministic=True, repeat=True)


def test_missing_gradients_give_zeros():
    """grad_out None: main gradients zero; kl_grad None: proxy gradients zero (the op's contract)."""
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    qp, kp, q, k, v = _inputs(1, 500, 8, 2, 2, 1, torch.bfloat16, seed=2)
    sel = _selection(qp, kp, 3, 0.1)
    out, lse, lse_p, _ = msa_forward_cuda(qp, kp, q, k, v, sel, 128, 0.1)
    dqp, dkp, dq, dk, dv = msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, 0.1, None,
                                             torch.ones(()))
    assert not dq.any() and not dk.any() and not dv.any() and dqp.abs().sum() > 0
    dqp, dkp, dq, dk, dv = msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, 0.1, torch.ones_like(q),
                                             None)
    assert not dqp.any() and not dkp.any() and dq.abs().sum() > 0


def test_deterministic_missing_gradients_give_zeros():
    """The deterministic backward with one gradient missing: that side's gradients are exactly zero."""
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    _skip_without_deterministic_kernels()
    qp, kp, q, k, v = _inputs(1, 500, 8, 2, 2, 1, torch.bfloat16, seed=3)
    sel = _selection(qp, kp, 3, 0.1)
    out, lse, lse_p, _ = msa_forward_cuda(qp, kp, q, k, v, sel, 128, 0.1)
    dqp, dkp, dq, dk, dv = msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, 0.1, None,
                                             torch.ones(()), deterministic=True)
    assert not dq.any() and not dk.any() and not dv.any() and dqp.abs().sum() > 0 and dkp.abs().sum() > 0
    dqp, dkp, dq, dk, dv = msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, 0.1, torch.ones_like(q),
                                             None, deterministic=True)
    assert not dqp.any() and not dkp.any() and dq.abs().sum() > 0 and dv.abs().sum() > 0


def _captured_and_eager(seed, deterministic):
    """(replayed, eager) outputs of one fwd + bwd: captured into a CUDA graph, replayed after q changed, and run
    eagerly on the changed q."""
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    qp, kp, q, k, v = _inputs(1, 1500, 8, 2, 2, 1, torch.bfloat16, seed=seed)
    scale = 128 ** -0.5
    sel = _selection(qp, kp, 4, scale)
    go = torch.randn_like(q)
    klg = torch.full((), 1e-3, device="cuda")

    def step():
        out, lse, lse_p, kl = msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
        return (out, kl, *msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, go, klg,
                                            deterministic))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    q.copy_(q.flip(1))
    graph.replay()
    torch.cuda.synchronize()
    return static, step()


def test_fwd_bwd_capture_in_a_cuda_graph():
    """Forward and backward never synchronise the host: both capture into one CUDA graph; the replay on new
    inputs gives eager's out and kl bitwise (the forward has no atomics) and its gradients up to the atomics'
    summation order."""
    from tests.test_block_sparse_gpu import _same_up_to_atomics

    replayed, eager = _captured_and_eager(4, False)
    for name, a, b in zip(("out", "kl"), replayed[:2], eager[:2]):
        assert torch.equal(a, b), f"{name}: the replay differs from eager"
    for name, a, b in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), replayed[2:], eager[2:]):
        _same_up_to_atomics(name, a, b)


def test_training_steps_match_the_reference():
    """A small MSA attention layer, 10 SGD steps through flash_msa_func on CUDA: selection, forward and backward
    on the kernels (dispatch's record says so) vs the reference backend, same data; the float32 master weights'
    updates agree within tests/training.UPDATE_TOL of their own norm."""
    import flash_msa_rt
    from tests.training import assert_training_matches_reference

    assert_training_matches_reference(
        lambda qp, kp, q, k, v: flash_msa_rt.flash_msa_func(qp, kp, q, k, v, 256, 128 ** -0.5, layout="bshd"),
        ops=("select_blocks", "msa_forward", "msa_backward"))


def test_deterministic_fwd_bwd_capture_in_a_cuda_graph():
    """The deterministic backward never synchronises the host either (item turns and sums come from shapes): a
    captured fwd + bwd replays to the same bits as an eager run on the same inputs."""
    _skip_without_deterministic_kernels()
    for a, b in zip(*_captured_and_eager(5, True)):
        assert torch.equal(a, b)


def test_deterministic_mode_runs_the_reproducible_backward():
    """Under torch.use_deterministic_algorithms the atomics-based kernels are declined: sm90a runs the
    deterministic kernels, other archs the reference (the warning is checked in test_kernel_dispatch_cpu); either
    way two backward passes through flash_msa_func give bitwise-identical gradients."""
    import flash_msa_rt
    from flash_msa_rt.ops import dispatch

    qp, kp, q, k, v = _inputs(1, 600, 8, 2, 2, 1, torch.bfloat16, seed=6)
    t = lambda x: x.transpose(1, 2).detach().requires_grad_()  # noqa: E731

    def grads():
        ins = [t(x) for x in (qp, kp, q, k, v)]
        out, kl = flash_msa_rt.flash_msa_func(*ins, 256, 128 ** -0.5)
        (out.float().pow(2).mean() + kl).backward()
        return [x.grad for x in ins]

    from flash_msa_rt.loader import device_arch
    from flash_msa_rt.ops import sparse_bwd
    from tests import routing

    kernels = sparse_bwd.deterministic_refusal(device_arch(torch.cuda.current_device())) is None
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:  # where there are no deterministic kernels, the reference is what this test asks for
        with contextlib.nullcontext() if kernels else routing.allowed_reference():
            impl = dispatch.implementation("msa_backward", torch.device("cuda"), torch.bfloat16, head_dim=128,
                                           proxy_head_dim=128, block_size=128, group=4, kv_group=4, varlen=False,
                                           deterministic=True)
            assert (impl is dispatch.reference_impl("msa_backward")) != kernels
            first = grads()
            second = grads()
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 333, 3), (1, 4099, 32)])
def test_delta_kernel_matches_float64(shape, dtype):
    """bwd_delta = rowsum(dO * O) in fp32, (B, H, S): against float64 on the same inputs, with O a transposed
    (B, H, S, D) view (the kernel takes any 16-byte strides) and rows of both signs. A sum of D products in fp32
    errs by at most ~D * 2^-24 of the sum of their magnitudes."""
    from flash_msa_rt.loader import get_kernel
    from flash_msa_rt.ops import sparse_bwd

    B, S, H = shape
    g = torch.Generator(device="cuda").manual_seed(S + H)
    do = (torch.randn(B, S, H, 128, device="cuda", generator=g) * 3).to(dtype)
    out = torch.randn(B, H, S, 128, device="cuda", generator=g).to(dtype).transpose(1, 2)
    delta = torch.full((B, H, S), float("nan"), device="cuda")
    get_kernel("bwd_delta", sparse_bwd.delta_config(sparse_bwd.sparse_fwd.DTYPES[dtype], 128), do.device)(
        dout=do, out=out, delta=delta)
    terms = do.double() * out.double()
    want = terms.sum(-1).transpose(1, 2)
    bound = 128 * 2.0 ** -24 * terms.abs().sum(-1).transpose(1, 2)
    assert torch.isfinite(delta).all()
    assert ((delta.double() - want).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_slot_sum_kernel_matches_its_statement(G, dtype):
    """The deterministic backward's slot_sum kernel against sparse_bwd_sums.slot_sums, bitwise (the same fp32
    additions in the same order): dead slots' rows are NaN and must not be read, the output is a strided view
    (a query chunk's rows of some heads) and nothing outside it is written."""
    from flash_msa_rt.loader import get_kernel
    from flash_msa_rt.ops import sparse_bwd, sparse_bwd_sums, sparse_fwd
    from flash_msa_rt.ops.sparse_plan import live_slots
    from tests.test_sparse_plan import random_indices

    B, Hp, S, K, offset = 2, 3, 700, 5, 256
    idx = random_indices(torch.Generator().manual_seed(G), B, Hp, S, K, 128).cuda()
    g = torch.Generator(device="cuda").manual_seed(G)
    part = torch.randn(B * Hp * S * K, G, 128, device="cuda", generator=g)
    part[~live_slots(idx, 128, offset).reshape(-1)] = float("nan")
    whole = torch.full((B, S + 3, Hp * G + 2, 128), float("nan"), dtype=dtype, device="cuda")
    out = whole[:, 1:S + 1, 1:Hp * G + 1]
    kernel = get_kernel("slot_sum", sparse_bwd.slot_sum_config(sparse_fwd.DTYPES[dtype], 128, 128, G), idx.device)
    kernel(block_indices=idx, part=part, out=out, query_offset=offset)
    assert torch.equal(out, sparse_bwd_sums.slot_sums(part, idx, 128, offset).to(dtype))
    outside = whole.clone()
    outside[:, 1:S + 1, 1:Hp * G + 1] = float("nan")
    assert outside.isnan().all()
