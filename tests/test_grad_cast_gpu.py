"""The gradient cast (kernels_src/grad_cast, flash_msa_rt/ops/grad_cast.py) on the GPU: fp32 accumulator rows
into a gradient's head slice and into the (B, H, S, D) layout's transposed view, bit for bit torch's copy_
(round to nearest even, ties, subnormals, overflow to inf, NaN as NaN), every element outside the view
untouched, the kernel the one that ran; and a backward in head chunks (strided casts) gives the gradients of one
chunk (contiguous casts) bit for bit in deterministic mode."""

import pytest
import torch

pytestmark = pytest.mark.gpu

B, S, H = 2, 333, 6


def accumulator(shape, seed):
    """Normal values with the cases a cast rounds differently: ties to even, subnormal, overflowing in fp16, NaN
    and infinities."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    acc = torch.randn(*shape, device="cuda", generator=g) * 3
    flat = acc.view(-1)
    bits = flat.view(torch.int32)
    n = flat.numel()
    idx = torch.randperm(n, device="cuda", generator=g)[:600]
    bits[idx[:100]] = (bits[idx[:100]] & ~0xFFFF) | 0x8000  # exact bf16 ties
    bits[idx[100:200]] = (bits[idx[100:200]] & ~0x1FFF) | 0x1000  # exact fp16 ties (13 dropped bits)
    flat[idx[200:300]] = 1e-40  # fp32 subnormal
    flat[idx[300:400]] = 7e4  # past fp16's largest
    flat[idx[400:450]] = float("nan")
    flat[idx[450:500]] = float("inf")
    flat[idx[500:550]] = -float("inf")
    flat[idx[550:600]] = -1e-7
    return acc


def same(a, b):
    """Equal bit for bit, except that any NaN equals any NaN."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("view", ["head_slice", "bhsd", "contiguous"])
def test_cast_into_is_torch_copy(dtype, D, view, launched_kernels):
    from flash_msa_rt.ops.grad_cast import cast_into

    sentinel = torch.tensor(-3.0, dtype=dtype)
    if view == "head_slice":
        full = torch.full((B, S, H, D), sentinel.item(), dtype=dtype, device="cuda")
        grad, heads = full[:, :, 2:5], slice(2, 5)
    elif view == "bhsd":
        full = torch.full((B, H, S, D), sentinel.item(), dtype=dtype, device="cuda")
        grad = full.transpose(1, 2)
    else:
        full = torch.full((B, S, H, D), sentinel.item(), dtype=dtype, device="cuda")
        grad = full
    acc = accumulator(grad.shape, seed=D + len(view))
    want = torch.empty(grad.shape, dtype=dtype, device="cuda").copy_(acc)
    assert cast_into(acc, grad) is grad
    assert [n for n in launched_kernels if n.startswith("grad_cast")] == \
        [f"grad_cast_{'bf16' if dtype == torch.bfloat16 else 'f16'}_d{D}_t256_sm90a"]
    assert same(grad, want)
    if view == "head_slice":  # the other heads untouched
        rest = torch.cat([full[:, :, :heads.start], full[:, :, heads.stop:]], 2)
        assert (rest == sentinel.to("cuda")).all()


def test_unaligned_or_unbuilt_views_take_torch_copy(launched_kernels):
    """Rows off 16-byte boundaries, D without a variant and CPU tensors are torch's copy_, with the same result."""
    from flash_msa_rt.ops.grad_cast import cast_into

    acc = accumulator((1, 40, 2, 128), seed=3)
    odd = torch.empty(1, 40, 2, 129, dtype=torch.bfloat16, device="cuda")[..., 1:]  # rows start 2 bytes in
    d96 = torch.empty(1, 40, 2, 96, dtype=torch.bfloat16, device="cuda")
    for grad, a in ((odd, acc), (d96, acc[..., :96].contiguous()), (torch.empty(1, 40, 2, 128, dtype=torch.bfloat16),
                                                                      acc.cpu())):
        assert same(cast_into(a, grad).cpu(), a.to(torch.bfloat16).cpu())
    assert not [n for n in launched_kernels if n.startswith("grad_cast")]


def test_backward_in_head_chunks_casts_as_one_chunk(launched_kernels):
    """The deterministic backward at a tau budget of one head per chunk casts each run's accumulators into head
    slices (grad_cast); its gradients equal one chunk's (contiguous casts) bit for bit."""
    from flash_msa_rt import tuning
    from flash_msa_rt.ops import sparse_bwd, sparse_fwd
    from flash_msa_rt.ops.select import select_blocks_cuda

    g = torch.Generator(device="cuda").manual_seed(17)
    Bq, Sq, Hq, Hkq, Hpq, D = 2, 1500, 16, 4, 4, 128
    qp, kp, q, k, v = (torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16) for s in
                       ((Bq, Sq, Hpq, D), (Bq, Sq, 1, D), (Bq, Sq, Hq, D), (Bq, Sq, Hkq, D), (Bq, Sq, Hkq, D)))
    scale = D ** -0.5
    sel = select_blocks_cuda(qp, kp, 4, 128, scale)
    out, lse, lse_p, _ = sparse_fwd.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    dout = torch.randn_like(q)
    klg = torch.full((Bq, Hpq, Sq), 1.0 / (Bq * Hpq * Sq), device="cuda")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        whole = sparse_bwd.msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, dout, klg, True)
        assert not [n for n in launched_kernels if n.startswith("grad_cast")]
        one_head = Bq * Sq * 4 * sparse_bwd.entry_bytes(128, Hq // Hpq, D, True)  # chunks of one head, every query
        with tuning.override(sparse_bwd={"deterministic_budget": one_head}):
            chunked = sparse_bwd.msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, dout, klg,
                                                   True)
    finally:
        torch.use_deterministic_algorithms(before)
    assert [n for n in launched_kernels if n.startswith("grad_cast")]
    for a, b in zip(chunked, whole):
        assert torch.equal(a, b)
