"""block_sparse_attention on the GPU kernels (flash_msa_rt.ops.block_sparse), through the public API, against the
float64 oracle (msa-semantics.md, "Generic block-sparse attention") on fresh random inputs and indices holding
repeats, -1 slots, blocks past the query's own and an all-empty row.

Tolerance: at most 4x what the input dtype costs the same computation (the float32 oracle's error against float64,
plus rounding the exact result to the input dtype); the kernels, like FlashAttention, also round P and dS to the
input dtype before their products.
"""

import pytest
import torch

from tests import oracle

pytestmark = pytest.mark.gpu

SHAPES = [  # B, S, H, Hk, Hi, K: kernel G = H / lcm(Hi, Hk)
    (1, 1, 4, 1, 1, 1),  # one token
    (2, 1000, 16, 2, 2, 5),  # NSA: one selection per KV head, G = 8
    (1, 777, 8, 2, 8, 16),  # one selection per query head, G = 1
    (1, 1500, 16, 4, 1, 4),  # one selection shared by every KV head: widened to 4 index heads, G = 4
    (1, 300, 12, 4, 3, 3),  # index heads across KV heads: lcm(3, 4) = 12 kernel heads, G = 1
    (2, 333, 32, 2, 2, 4),  # G = 16
    (1, 2049, 16, 2, 4, 9),  # odd S past a block edge, G = 4
]
BLOCK = 128


def _indices(B, Hi, S, K, gen):
    nb = -(-S // BLOCK)
    idx = torch.randint(-1, nb, (B, Hi, S, K), generator=gen, dtype=torch.int32, device="cuda")
    idx[..., 0] = (torch.arange(S, device="cuda", dtype=torch.int32) // BLOCK).view(1, 1, S)  # the local block
    idx[0, 0, S // 2] = -1  # a row with no allowed key: out 0, lse -inf
    if K > 1:
        idx[-1, -1, -1, 1] = idx[-1, -1, -1, 0]  # a repeat counts once
    return idx


def _inputs(B, S, H, Hk, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(dtype)  # noqa: E731
    return rnd(B, S, H, 128), rnd(B, S, Hk, 128), rnd(B, S, Hk, 128), rnd(B, S, H, 128), g


def _ran_on_kernels(q, k, Hi, op="block_sparse_forward"):
    from flash_msa_rt.ops import dispatch, kernels, library

    config = library._block_sparse_config(q, k, torch.empty(1, Hi, 1, 1), BLOCK, None)
    if op == "block_sparse_backward":
        config["deterministic"] = torch.are_deterministic_algorithms_enabled()
    impl = dispatch.implementation(op, q.device, q.dtype, **config)
    return impl is kernels.KERNELS.ops[op]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_block_sparse_attention_matches_oracle(shape, dtype):
    from flash_msa_rt import block_sparse_attention

    B, S, H, Hk, Hi, K = shape
    q, k, v, dout, g = _inputs(B, S, H, Hk, dtype, seed=sum(shape))
    idx = _indices(B, Hi, S, K, g)
    assert _ran_on_kernels(q, k, Hi) and _ran_on_kernels(q, k, Hi, "block_sparse_backward")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = block_sparse_attention(*leaves, idx, BLOCK, layout="bshd", return_lse=True)
    (out * dout).sum().backward()
    scale = 128 ** -0.5
    want = oracle.block_sparse(*(t.double() for t in (q, k, v)), idx, BLOCK, scale, grad_out=dout.double())
    base = oracle.block_sparse(*(t.float() for t in (q, k, v)), idx, BLOCK, scale, grad_out=dout.float())
    assert out.dtype == dtype and lse.dtype == torch.float32
    oracle.check("out", out, want.out, dtype, base.out, factor=4.0)
    oracle.check("lse", lse, want.lse, torch.float32, base.lse, factor=4.0)
    for name, leaf in zip("qkv", leaves):
        assert leaf.grad.dtype == dtype
        oracle.check(f"d{name}", leaf.grad, want.grads[name], dtype, base.grads[name], factor=4.0)
    G = H // Hi
    assert not out[0, S // 2, :G].any() and torch.isinf(lse[0, :G, S // 2]).all()


def test_out_of_range_index_is_an_error():
    from flash_msa_rt import block_sparse_attention

    q, k, v, _, g = _inputs(1, 300, 8, 2, torch.bfloat16, seed=5)
    idx = _indices(1, 2, 300, 4, g)
    idx[0, 1, 200, 2] = 3  # 300 tokens: blocks 0..2
    with pytest.raises(ValueError, match=r"block_indices\[0, 1, 200, 2\] = 3 is outside \[-1, 3\)"):
        block_sparse_attention(q, k, v, idx, BLOCK, layout="bshd")


def _same_up_to_atomics(name, got, want):
    """Two runs of a backward that adds in fp32 atomics: the order of the additions differs, nothing else. That
    moves an fp32 sum by a few ulps of the magnitude of its terms, which the final rounding to the 16-bit dtype
    can turn into one ulp of the result: per element within one ulp of the dtype at its magnitude, plus a floor of
    2^-16 of the gradient's scale for elements near zero (sums that cancel). A wrong or missing term moves an
    element by the term's size, far past either."""
    ulp = 2.0 ** -7 if want.dtype == torch.bfloat16 else 2.0 ** -10
    g, w = got.double(), want.double()
    bound = ulp * w.abs() + 2.0 ** -16 * w.abs().max()
    assert ((g - w).abs() <= bound).all(), f"{name}: {((g - w).abs() - bound).max().item():.3e} past the bound"


def test_forward_and_backward_capture_in_a_cuda_graph():
    """A captured fwd + bwd replays to the eager results (no host read inside: the index range check is skipped
    under capture), and an out-of-range index captured poisons the output with NaN instead of raising."""
    from flash_msa_rt import block_sparse_attention

    q, k, v, dout, g = _inputs(2, 1000, 16, 2, torch.bfloat16, seed=7)
    idx = _indices(2, 2, 1000, 8, g)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        out = block_sparse_attention(*leaves, idx, BLOCK, layout="bshd")
        (out * dout).sum().backward()
        return out

    eager = step().detach().clone()
    eager_grads = [t.grad.clone() for t in leaves]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up on the capture stream (allocator pools, lazy kernel loads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    for name, t, e in zip("qkv", leaves, eager_grads):
        _same_up_to_atomics(f"d{name}", t.grad, e)

    idx[1, 0, 500, 3] = 99
    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            poisoned = block_sparse_attention(q, k, v, idx, BLOCK, layout="bshd")
        graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(poisoned).all()


@pytest.mark.allow_reference
def test_deterministic_mode_declines_the_backward_to_the_reference():
    """The backward kernel adds with fp32 atomics: under deterministic algorithms dispatch names the reference, and
    says why (the warning is re-armed for every test by conftest's reset, so this test always sees it)."""
    q, k, _, _, _ = _inputs(1, 8, 8, 2, torch.bfloat16, seed=9)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.warns(RuntimeWarning, match="block-sparse backward kernel adds with fp32 atomics"):
            assert not _ran_on_kernels(q, k, 2, "block_sparse_backward")
        assert _ran_on_kernels(q, k, 2)  # the forward has no atomics
    finally:
        torch.use_deterministic_algorithms(False)
