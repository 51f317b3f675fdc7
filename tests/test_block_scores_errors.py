"""Every error branch of proxy_block_scores, on CPU (issue 40): validation runs before any kernel is looked up.
Its inputs must be CUDA tensors; past that check the tests use CPU tensors that say they are on CUDA (_OnCuda),
so the later branches are reached without a GPU."""

from __future__ import annotations

import re

import pytest
import torch

from flash_msa_rt import proxy_block_scores


class _OnCuda(torch.Tensor):
    """A CPU tensor whose is_cuda says True: what validation asks before it checks shapes and values."""

    @property
    def is_cuda(self):
        return True


def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype).as_subclass(_OnCuda)


Q, K = (1, 256, 2, 128), (1, 256, 1, 128)


@pytest.mark.parametrize("q, k, error, message", [
    ("not a tensor", _t(*K), TypeError, "q_proxy must be a torch.Tensor, got str"),
    (_t(*Q), None, TypeError, "k_proxy must be a torch.Tensor, got NoneType"),
    (_t(256, 2, 128), _t(*K), ValueError, "q_proxy must be (batch, seqlen, heads, head_dim), got shape (256, 2, 128)"),
    (_t(*Q, dtype=torch.float16), _t(*K, dtype=torch.float16), TypeError,
     "q_proxy has dtype torch.float16; supported: ['torch.bfloat16']"),
    (torch.zeros(Q, dtype=torch.bfloat16), torch.zeros(K, dtype=torch.bfloat16), ValueError,
     "q_proxy must be on a CUDA device, got cpu"),
    (_t(*Q), _t(1, 255, 1, 128), ValueError,
     "k_proxy shape (1, 255, 1, 128) does not match q_proxy (1, 256, 2, 128) in batch, seqlen or head_dim"),
    (_t(*Q), _t(*K).to(torch.float16).as_subclass(_OnCuda), TypeError, "k_proxy has dtype torch.float16"),
    (_t(1, 256, 2, 128), _t(1, 256, 3, 128), ValueError, "proxy heads 2 must be a multiple of proxy key heads 3"),
    (_t(1, 256, 2, 96), _t(1, 256, 1, 96), NotImplementedError,
     "head_dim 96 is not supported; supported: (64, 128)"),
])
def test_bad_inputs_are_named(q, k, error, message):
    with pytest.raises(error, match=re.escape(f"proxy_block_scores: {message}")):
        proxy_block_scores(q, k)


def test_k_proxy_of_another_dtype_or_device_than_q_proxy():
    """Both bf16-checked one by one; then the pair must agree in device (meta: another device, still 'on CUDA')."""
    k_meta = torch.zeros(K, dtype=torch.bfloat16, device="meta").as_subclass(_OnCuda)
    with pytest.raises(ValueError, match=re.escape("proxy_block_scores: k_proxy (torch.bfloat16, meta) must match "
                                                   "q_proxy (torch.bfloat16, cpu)")):
        proxy_block_scores(_t(*Q), k_meta)


@pytest.mark.parametrize("block_size", [32, 256])
def test_unsupported_block_size(block_size):
    with pytest.raises(NotImplementedError, match=re.escape(
            f"proxy_block_scores: block_size {block_size} is not supported; supported: (64, 128)")):
        proxy_block_scores(_t(*Q), _t(*K), block_size=block_size)


@pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), float("inf"), True, "0.1"])
def test_scale_must_be_finite_positive(scale):
    with pytest.raises(ValueError, match=re.escape(
            f"proxy_block_scores: scale must be a finite positive number, got {scale!r}")):
        proxy_block_scores(_t(*Q), _t(*K), scale=scale)


@pytest.mark.parametrize("out", [
    torch.zeros(1, 2, 256, 3),  # wrong shape (2 key blocks)
    torch.zeros(1, 2, 256, 2, dtype=torch.float64),  # wrong dtype
    torch.zeros(1, 2, 2, 256).transpose(2, 3),  # not contiguous
    torch.zeros(1, 2, 256, 2, device="meta"),  # another device than q_proxy
    "not a tensor",
])
def test_out_must_fit_the_result(out):
    with pytest.raises(ValueError, match=re.escape(
            "proxy_block_scores: out must be a contiguous float32 tensor of shape (1, 2, 256, 2) on cpu")):
        proxy_block_scores(_t(*Q), _t(*K), out=out)
