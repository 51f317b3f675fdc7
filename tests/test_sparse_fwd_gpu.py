"""The MSA sparse forward kernels (sparse_fwd + sparse_kl) on the GPU, against the float64 oracle (tests/oracle.py,
msa-semantics.md, "Main sparse attention" and "Proxy KL loss") on the kernel's own block_indices, on fresh random
inputs.

Tolerances (flash_msa_rt.tolerances, the GPU suite's one rule): the kernel may cost 4x what the input dtype costs
the same computation by an independent path, the oracle run in float32 from the same 16-bit inputs, plus the
rounding of the exact result to the input dtype for 16-bit outputs, plus 1e-5 of the result's magnitude.
Where the kernel's answer is exact (no atomics, the same arithmetic in another order of launches), it must be
bitwise equal.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [  # B, S, H, Hk, Hp, Hpk, K: odd lengths, partial blocks, every G, Hp = Hk and Hp > Hk, Hpk > 1
    (1, 1, 4, 1, 1, 1, 1),
    (1, 300, 4, 1, 1, 1, 3),
    (2, 1000, 16, 2, 4, 1, 4),
    (1, 777, 8, 8, 8, 2, 16),
    (1, 2049, 16, 1, 1, 1, 8),
    (1, 1500, 8, 2, 4, 4, 5),
    (1, 3000, 16, 2, 2, 1, 16),
]


def _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed, std=1.0, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * std).to(dtype)

    return rnd(B, S, Hp, D), rnd(B, S, Hpk, D), rnd(B, S, H, D), rnd(B, S, Hk, D), rnd(B, S, Hk, D)


def _selection(qp, kp, K, scale):
    from flash_msa_rt.ops.select import select_blocks_cuda

    return select_blocks_cuda(qp, kp, K, 128, scale)


def _check_forward(qp, kp, q, k, v, sel, scale):
    """The kernel's out, lse, lse_proxy and kl_rows against the float64 oracle, within the tolerance rule."""
    from flash_msa_rt import tolerances
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda
    from tests import oracle

    got = msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    torch.cuda.synchronize()
    want, base = (oracle.msa(*(t.to(dt) for t in (qp, kp, q, k, v)), sel.shape[-1], 128, scale, block_indices=sel)
                  for dt in (torch.float64, torch.float32))
    for name, g_ in zip(("out", "lse", "lse_proxy", "kl_rows"), got):
        dtype = q.dtype if name == "out" else torch.float32
        tolerances.assert_ok(tolerances.check(name, g_, getattr(want, name), getattr(base, name), result_dtype=dtype))
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(shape, dtype):
    B, S, H, Hk, Hp, Hpk, K = shape
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=S + H)
    scale = 128 ** -0.5
    _check_forward(qp, kp, q, k, v, _selection(qp, kp, K, scale), scale)


# (mma, schedule, q buffers) x G; the KL pass: resident heads at G <= 4, streamed at 8, 16. One q buffer is not
# built at G = 1 (it spills at two CTAs per SM), so that pair is not a case.
FORWARD_BUILDS = [(mma, schedule, stages, G)
                  for mma, schedule, stages in (("sync", "lockstep", None), ("wgmma", "lockstep", None),
                                                ("wgmma", "pingpong", 2), ("wgmma", "pingpong", 1))
                  for G in (1, 4, 8, 16) if not (stages == 1 and G == 1)]


@pytest.mark.parametrize("mma,schedule,stages,G", FORWARD_BUILDS)
def test_both_forward_kernels_match_reference(mma, schedule, stages, G, force_mma, tuned):
    """Hopper builds the forward four times (mma.sync; wgmma with the warpgroups in lockstep, and in ping-pong
    with two q buffers and with one, which the runtime picks there at G >= 2), and the KL pass on each schedule
    (the schedule applies to both): all are checked, on odd S, whatever the device's default."""
    from flash_msa_rt.ops import sparse_fwd

    force_mma(mma)
    tuned(sparse_fwd={"schedule": schedule, "kl_schedule": schedule, **({"stages": stages} if stages else {})})
    t = sparse_fwd.choice("sm90a", G)
    assert (t.mma, t.schedule, t.kl_schedule) == (mma, schedule, schedule)
    assert t.stages == (stages or (1 if schedule == "pingpong" and G >= 2 else 2))
    H = 16
    qp, kp, q, k, v = _inputs(1, 1500, H, 1, H // G, 1, torch.bfloat16, seed=G)
    scale = 128 ** -0.5
    _check_forward(qp, kp, q, k, v, _selection(qp, kp, 6, scale), scale)


def test_skewed_selection_every_query_picks_block_zero():
    """Hot lists: every query keeps block 0 and its nearest earlier blocks, so block 0's list spans all S queries
    and is cut into many bounded items."""
    B, S, H, Hk, Hp, Hpk, K = 1, 4000, 8, 2, 2, 1, 6
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=11)
    i = torch.arange(S, device="cuda")
    local = i // 128
    slots = [torch.zeros_like(local)] + [local - d for d in range(K - 2, 0, -1)] + [local]
    sel = torch.stack(slots, -1)
    sel = torch.where(sel < 0, torch.full_like(sel, -1), sel)
    # Duplicates (block 0 twice for early rows) are not a valid selection: drop repeats to -1.
    dup = torch.zeros_like(sel, dtype=torch.bool)
    for s in range(1, K):
        dup[:, s] = (sel[:, s:s + 1] == sel[:, :s]).any(-1) & (sel[:, s] >= 0)
    sel = torch.where(dup, torch.full_like(sel, -1), sel).to(torch.int32)
    sel = sel.view(1, 1, S, K).expand(B, Hp, S, K).contiguous()
    _check_forward(qp, kp, q, k, v, sel, 128 ** -0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_logits_stay_finite(dtype):
    """Logits with standard deviation ~30 and a large per-row shift, in bf16 and fp16 inputs: the forward and the
    backward match the float64 reference within the tolerance rule, with no inf or NaN anywhere (FSA overflows
    here)."""
    from tests.test_sparse_bwd_gpu import _check_backward

    B, S, H, Hk, Hp, Hpk, K = 1, 1000, 8, 2, 2, 1, 4
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, dtype, seed=3)
    std = 30.0 / 128 ** 0.25  # scale * (q . k) then has standard deviation std**2 = 30 / sqrt(D) * sqrt(D) = 30
    q = (q.float() * std + 4.0).to(dtype)  # + a per-row shift through the mean of q
    k = (k.float() * std).to(dtype)
    qp, kp = (qp.float() * std).to(dtype), (kp.float() * std).to(dtype)
    scale = 128 ** -0.5
    logits = (q[0, :, 0].float() @ k[0, :, 0].float().T) * scale
    assert logits.std() > 25.0, "the test must exercise large logits"
    sel = _selection(qp, kp, K, scale)
    out, lse, lse_p, kl = _check_forward(qp, kp, q, k, v, sel, scale)
    grads = _check_backward(qp, kp, q, k, v, sel, scale, seed=3)  # the five gradients against float64
    for name, t in zip(("out", "lse", "lse_proxy", "kl", "dq_proxy", "dk_proxy", "dq", "dk", "dv"),
                       (out, lse, lse_p, kl, *grads)):
        assert torch.isfinite(t).all(), f"{name} has inf or NaN"


def sampled_rows(S):
    """Query rows whose exact statistics a long-sequence test checks: the first, block edges, and the last ones."""
    picked = {0, 1, 127, 128, S // 2, S // 2 + 1, S - 129, S - 128, S - 2, S - 1}
    return sorted(i for i in picked | set(range(0, S, max(1, S // 48))) if 0 <= i < S)


def test_long_sequence_32k():
    """S = 32K, configuration (a) heads. out (bf16) against the float32 reference, whose own error is ~2^-24 of
    the output, far below the bf16 rounding the rule allows for (4x of it); the float32 statistics (lse,
    lse_proxy, kl_rows) on sampled rows, the last ones included, against those rows' float64 oracle with the float32
    oracle as the baseline (float64 over all 32K rows would take minutes)."""
    from flash_msa_rt import reference, tolerances
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda
    from tests import oracle

    B, S, H, Hk, Hp, Hpk, K = 1, 32768, 16, 2, 4, 1, 16
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=7)
    scale = 128 ** -0.5
    sel = _selection(qp, kp, K, scale)
    got = msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    want_out = reference.msa_forward(*(t.float() for t in (qp, kp, q, k, v)), sel, 128, scale)[0]
    tolerances.assert_ok(tolerances.check("out", got[0], want_out, result_dtype=torch.bfloat16))
    picked = sampled_rows(S)
    exact, base = (oracle.rows(*(t.to(dt) for t in (qp, kp, q, k, v)), picked, scale, sel, 128)
                   for dt in (torch.float64, torch.float32))
    for name, g_ in zip(("lse", "lse_proxy", "kl_rows"), got[1:]):
        tolerances.assert_ok(tolerances.check(name, g_[..., picked], getattr(exact, name), getattr(base, name),
                                              result_dtype=torch.float32))


def test_cuda_graph_capture_and_replay():
    """The forward never synchronises the host: it captures into a CUDA graph, and replays equal eager."""
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    qp, kp, q, k, v = _inputs(1, 1500, 8, 2, 2, 1, torch.bfloat16, seed=4)
    scale = 128 ** -0.5
    sel = _selection(qp, kp, 4, scale)
    eager = msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)  # warm the loader's caches outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    q.copy_(q.flip(1))  # new inputs in place: the replay must see them
    graph.replay()
    torch.cuda.synchronize()
    again = msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    for a, b in zip(static, again):
        assert torch.equal(a, b)
    assert not torch.equal(static[0], eager[0])


def test_public_api_routes_forward_to_the_kernel():
    """flash_msa_func on CUDA runs the sparse forward kernel: its out and kl_loss equal the launcher's."""
    import flash_msa_rt
    from flash_msa_rt.ops import dispatch

    impl = dispatch.implementation("msa_forward", torch.device("cuda"), torch.bfloat16, head_dim=128,
                                   proxy_head_dim=128, block_size=128, group=4, kv_group=8, varlen=False)
    assert impl is not dispatch.reference_impl("msa_forward"), "msa_forward fell back to the reference"
    B, S, H, Hk, Hp = 1, 900, 16, 2, 4
    qp, kp, q, k, v = _inputs(B, S, H, Hk, Hp, 1, torch.bfloat16, seed=9)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, kl = flash_msa_rt.flash_msa_func(t(qp), t(kp), t(q), t(k), t(v), 512, 128 ** -0.5)
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    sel = _selection(qp, kp, 4, 128 ** -0.5)
    ref = msa_forward_cuda(qp, kp, q, k, v, sel, 128, 128 ** -0.5)
    torch.testing.assert_close(out, ref[0].reshape(B, S, H * 128), rtol=0, atol=0)
    torch.testing.assert_close(kl, ref[3].mean(), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("chunks", ["heads", "queries"])
def test_query_chunks_bound_the_partials(chunks, tuned):
    """A small partials budget cuts the forward into chunks: of one proxy head and some queries (head-sliced
    views; two proxy heads share a KV head, four the proxy key head), or of every head and fewer queries. The
    results are bitwise those of one chunk (an entry's partial does not depend on the other rows of its tile), and
    the peak memory drops."""
    from flash_msa_rt.ops import sparse_fwd

    tuned(sparse_fwd={"chunks": chunks})

    qp, kp, q, k, v = _inputs(2, 3000, 16, 2, 4, 1, torch.bfloat16, seed=8)
    scale = 128 ** -0.5
    sel = _selection(qp, kp, 16, scale)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    whole = sparse_fwd.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    torch.cuda.synchronize()
    peak_whole = torch.cuda.max_memory_allocated() - base
    budget = sparse_fwd.choice("sm90a", 4, 128, 128, 2, 3000, 16).partials_budget  # the 2 GiB floor
    assert sparse_fwd.query_chunk(2, 3000, 4, 16, 4, 128, 128, budget) == 3072  # one chunk by default
    budget = 4 << 20
    tuned(sparse_fwd={"partials_budget": budget})
    assert sparse_fwd.query_chunk(2, 3000, 4, 16, 4, 128, 128, budget) < 3000  # several chunks
    heads, queries = sparse_fwd.forward_chunks(2, 3000, 4, 2, 1, 16, 4, 128, 128, budget, chunks)
    assert (heads, queries < 3000) == ((1, True) if chunks == "heads" else (4, True))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    chunked = sparse_fwd.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    torch.cuda.synchronize()
    peak_chunked = torch.cuda.max_memory_allocated() - base
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)
    assert peak_chunked < peak_whole / 2, (peak_chunked, peak_whole)


# key groups per slot: the ping-pong KL pass writes 1, the lockstep wgmma one 2, mma.sync 4
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_combine_kl_kernel_matches_its_torch_statement(groups):
    """sparse_combine_kl against partials.combine_kl_lse in float64 on random (A, T, L) triples, a chunk of
    queries at an offset: dead slots (-1, blocks after the local one) hold NaN that must be skipped, some groups
    have L = -inf (no causal key in them), some rows have no live slot at all (lse_proxy -inf, KL 0), and the
    outputs are views of longer (B, Hp, S) tensors that must stay untouched outside the chunk."""
    from flash_msa_rt.loader import get_kernel
    from flash_msa_rt.ops.sparse_fwd import combine_kl_config
    from types import SimpleNamespace

    from flash_msa_rt.ops.partials import combine_kl_lse

    g = torch.Generator(device="cuda").manual_seed(groups)
    B, Hp, S_total, K, Bs, s0 = 2, 3, 1300, 37, 128, 384  # K * groups > 32: lanes take several pairs
    S = S_total - s0
    i = torch.arange(s0, S_total, device="cuda").view(1, 1, S, 1)
    sel = torch.randint(-1, S_total // Bs + 2, (B, Hp, S, K), device="cuda", generator=g, dtype=torch.int32)
    sel[:, :, ::7] = -1  # rows without a live slot
    E, C = B * Hp * S * K, 3 * groups
    parts = torch.randn(E, groups, 3, device="cuda", generator=g, dtype=torch.float64)
    parts[..., 0] *= 3.0
    parts[..., 1] = parts[..., 1].abs() / (K * groups)
    parts[..., 2] = parts[..., 2] * 20.0 + 5.0
    parts[..., 2] = torch.where(torch.rand(E, groups, device="cuda", generator=g) < 0.2, float("-inf"),
                                parts[..., 2])
    live = ((sel >= 0) & (sel <= i // Bs)).reshape(E, 1, 1)
    parts = torch.where(live, parts, float("nan"))
    kl_part = parts.reshape(E, C).float()  # the kernel's fp32 parts; the statement sums them in float64
    plan = SimpleNamespace(B=B, Hp=Hp, S=S, K=K, E=E, block_size=Bs, query_offset=s0,
                           key_offset=0)  # what the merge reads
    want_lse, want_kl = combine_kl_lse(plan, sel, kl_part.double())

    lse_proxy = torch.full((B, Hp, S_total), 7.0, device="cuda")
    kl_rows = torch.full((B, Hp, S_total), 7.0, device="cuda")
    get_kernel("sparse_combine_kl", combine_kl_config(Bs), sel.device)(
        block_indices=sel, kl_part=kl_part, lse_proxy=lse_proxy[:, :, s0:], kl_rows=kl_rows[:, :, s0:],
        query_offset=s0)
    torch.cuda.synchronize()
    assert (lse_proxy[:, :, :s0] == 7.0).all() and (kl_rows[:, :, :s0] == 7.0).all(), "wrote outside the chunk"
    got_lse, got_kl = lse_proxy[:, :, s0:].double(), kl_rows[:, :, s0:].double()
    dead = ~(want_lse > float("-inf"))
    assert dead.any() and (~dead).any()
    assert torch.equal(torch.isneginf(got_lse), dead), "rows without a live slot must get lse_proxy = -inf"
    assert (got_kl[dead] == 0).all()
    assert torch.isfinite(got_kl).all() and torch.isfinite(got_lse[~dead]).all()
    # fp32 sums of up to K * groups terms and fast exp2 / log2: a few ulp of fp32 per term of each row's magnitude
    # (sum |A| ln 2 + |lse_proxy| sum T); a wrong slot, group or liveness moves a row by a whole term
    a_abs = torch.where(live.view(E, 1), kl_part.view(E, groups, 3)[..., 0].double().abs(), 0).view(B, Hp, S, -1)
    t_sum = torch.where(live.view(E, 1), kl_part.view(E, groups, 3)[..., 1].double(), 0).view(B, Hp, S, -1).sum(-1)
    mag = a_abs.sum(-1) * 0.7 + want_lse.nan_to_num(0, 0, 0).abs() * t_sum + 1.0
    err_lse = (got_lse - want_lse)[~dead].abs()
    assert (err_lse <= 1e-6 * (want_lse[~dead].abs() + 1.0) * K * groups).all(), err_lse.max()
    err_kl = (got_kl - want_kl).abs()
    assert (err_kl <= 1e-6 * mag * 4).all(), (err_kl / mag).max()


@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
def test_combine_heads_per_warp_change_no_bit(G, tuned):
    """The shipped combine merges up to 4 of a row's heads per warp (16 elements per lane); the one-head-per-warp
    kernel does the same arithmetic per element in the same slot order, so out and lse are bitwise equal, at
    every G and with empty slots (K past the causal blocks of the early queries)."""
    from flash_msa_rt.ops import sparse_fwd

    Hp = 2
    qp, kp, q, k, v = _inputs(1, 1100, Hp * G, 2, Hp, 1, torch.bfloat16, seed=30 + G)
    scale = 128 ** -0.5
    sel = _selection(qp, kp, 6, scale)
    wide = sparse_fwd.msa_forward_cuda(None, None, q, k, v, sel, 128, scale)
    tuned(sparse_fwd={"combine_heads": 1})
    narrow = sparse_fwd.msa_forward_cuda(None, None, q, k, v, sel, 128, scale)
    assert sparse_fwd.choice("sm90a", G).combine_heads == 1
    for a, b in zip(wide[:2], narrow[:2]):
        assert torch.equal(a, b)
    assert torch.isfinite(wide[0]).all() and wide[0].abs().max() > 0
