"""Gradients come back in their inputs' layout (torch.empty_like's): with (B, heads, S, D) leaves, the default
layout, a (B, S, heads, D)-contiguous gradient would make autograd copy it into the leaf's layout, a transient
copy of each gradient (+8 GiB for q at (b) 1M, docs/memory.md). CPU: the ops' contract on the reference backend
(converted there); GPU: the kernels write that layout themselves, in atomic and deterministic mode."""

from __future__ import annotations

import pytest
import torch

import flash_msa_rt as F
from flash_msa_rt.ops import library

NAMES = ("q_proxy", "k_proxy", "q", "k", "v")


def _leaves(B, S, heads, D, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(B, h, S, D, device=device, generator=g).to(dtype).requires_grad_() for h in heads]


def _bshd(t):
    return t.transpose(1, 2)


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "warmup"])
def test_op_gradients_have_their_inputs_layout(sparse):
    """The backward ops' gradients are laid out like their (B, S, heads, D) input views, here transposed views of
    (B, heads, S, D) tensors, so the leaves' gradients are contiguous (B, heads, S, D) without a copy."""
    leaves = _leaves(1, 200, (2, 1, 4, 2, 2), 16, "cpu", torch.float64, 0)
    fn = F.flash_msa_func if sparse else F.flash_msa_warmup_func
    out, kl = fn(*leaves, top_k=128, block_size=64)
    grads = torch.autograd.grad(out.square().sum() + kl, leaves)
    assert all(g.is_contiguous() for g in grads)
    x = [_bshd(t.detach()) for t in leaves]
    sel = library.select_blocks(x[0], x[1], 2, 64, 0.25)
    o, lse, lse_p, _ = library.msa_forward(*x, sel, 64, 0.25)
    dq = library.msa_backward(*x, o, lse, lse_p, sel, 64, 0.25, torch.randn_like(o), torch.ones(1, 2, 200))
    for name, t, g in zip(NAMES, x, dq):
        assert g.stride() == t.stride(), name


def test_non_dense_inputs_get_contiguous_gradients():
    """A slice of a fused projection is not dense: its gradient is contiguous, as torch.empty_like makes it."""
    fused = torch.randn(1, 150, 10, 16, dtype=torch.float64)
    qp, kp, q, k, v = fused[:, :, :2], fused[:, :, 2:3], fused[:, :, 3:7], fused[:, :, 7:8], fused[:, :, 8:9]
    sel = library.select_blocks(qp, kp, 2, 64, 0.25)
    o, lse, lse_p, _ = library.msa_forward(qp, kp, q, k, v, sel, 64, 0.25)
    grads = library.msa_backward(qp, kp, q, k, v, o, lse, lse_p, sel, 64, 0.25, torch.randn_like(o),
                                 torch.ones(1, 2, 150))
    assert all(g.is_contiguous() for g in grads)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_kernel_gradients_are_written_in_the_inputs_layout(deterministic):
    """The kernel backend's own gradients (not converted afterwards) have the (B, heads, S, D) inputs' layout."""
    if not torch.cuda.is_available():
        pytest.skip("GPU test: no CUDA device")
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda
    from flash_msa_rt.ops.select import select_blocks_cuda

    x = [_bshd(t.detach()) for t in _leaves(2, 700, (2, 1, 8, 2, 2), 128, "cuda", torch.bfloat16, 1)]
    sel = select_blocks_cuda(x[0], x[1], 3, 128, 0.09)
    o, lse, lse_p, kl = msa_forward_cuda(*x, sel, 128, 0.09)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        grads = msa_backward_cuda(*x, o, lse, lse_p, sel, 128, 0.09, torch.randn_like(o), torch.ones_like(kl),
                                  deterministic)
    finally:
        torch.use_deterministic_algorithms(before)
    for name, t, g in zip(NAMES, x, grads):
        assert g.stride() == t.stride(), (name, g.stride(), t.stride())
