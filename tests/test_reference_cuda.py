"""The references are device-agnostic: on a CUDA device (float64, so TF32 cannot hide) they equal the CPU run."""

from __future__ import annotations

import pytest
import torch

import oracle
from flash_msa_rt import reference as ref

pytestmark = pytest.mark.gpu  # conftest skips it without a usable GPU (fails under FLASH_MSA_REQUIRE_GPU=1)


def _same(a, b):
    if isinstance(a, (tuple, list)):
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a.device.type == "cuda" and a.dtype == b.dtype
        torch.testing.assert_close(a.cpu(), b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_every_op_on_cuda_equals_cpu(dtype):
    B, S, H, Hk, Hp, Hpk, D, Dp, Bs, K = 1, 150, 8, 2, 4, 2, 32, 16, 32, 3
    gen = torch.Generator().manual_seed(0)
    x = [oracle.randn(gen, s, dtype) for s in ((B, S, Hp, Dp), (B, S, Hpk, Dp), (B, S, H, D), (B, S, Hk, D),
                                               (B, S, Hk, D))]
    do = oracle.randn(gen, (B, S, H, D), dtype)
    w = oracle.randn(gen, (B, Hp, S), torch.float32)
    cu = torch.tensor([0, 50, 50, 150], dtype=torch.int32)
    dev = [t.cuda() for t in x]
    sc = D ** -0.5
    # bf16 inputs compute in fp32 on both devices, in different orders: compare loosely there.
    same = _same if dtype == torch.float64 else (lambda a, b: _loose(a, b))

    idx = ref.select_blocks(*x[:2], K, Bs, sc)
    if dtype == torch.float64:
        _same(ref.select_blocks(*dev[:2], K, Bs, sc), idx)
        _same(ref.select_blocks_varlen(*dev[:2], cu.cuda(), K, Bs, sc), ref.select_blocks_varlen(*x[:2], cu, K, Bs, sc))
    fwd = ref.msa_forward(*x, idx, Bs, sc)
    fwd_d = ref.msa_forward(*dev, idx.cuda(), Bs, sc)
    same(fwd_d, fwd)
    same(ref.msa_backward(*dev, *fwd_d[:3], idx.cuda(), Bs, sc, do.cuda(), w.cuda()),
         ref.msa_backward(*x, *fwd[:3], idx, Bs, sc, do, w))
    fwd = ref.warmup_forward(*x, sc)
    fwd_d = ref.warmup_forward(*dev, sc)
    same(fwd_d, fwd)
    same(ref.warmup_backward(*dev, *fwd_d[:3], sc, do.cuda(), torch.tensor(0.5, device="cuda")),
         ref.warmup_backward(*x, *fwd[:3], sc, do, torch.tensor(0.5)))
    fb = ref.block_sparse_forward(*x[2:], idx, Bs, sc)
    fb_d = ref.block_sparse_forward(*dev[2:], idx.cuda(), Bs, sc)
    same(fb_d, fb)
    same(ref.block_sparse_backward(*dev[2:], *fb_d, idx.cuda(), Bs, sc, do.cuda()),
         ref.block_sparse_backward(*x[2:], *fb, idx, Bs, sc, do))
    vi = ref.select_blocks_varlen(*x[:2], cu, K, Bs, sc)
    fv = ref.msa_forward_varlen(*x, vi, cu, Bs, sc)
    fv_d = ref.msa_forward_varlen(*dev, vi.cuda(), cu.cuda(), Bs, sc)
    same(fv_d, fv)
    same(ref.msa_backward_varlen(*dev, *fv_d[:3], vi.cuda(), Bs, sc, do.cuda(), cu.cuda(), w.cuda()),
         ref.msa_backward_varlen(*x, *fv[:3], vi, Bs, sc, do, cu, w))


def _loose(a, b):
    if isinstance(a, (tuple, list)):
        for x, y in zip(a, b, strict=True):
            _loose(x, y)
        return
    assert a.device.type == "cuda" and a.dtype == b.dtype
    a, b = a.cpu().double(), b.double()
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    fin = torch.isfinite(b)
    # One bf16 ulp of the magnitude (either device may round the other way), fp32 results far tighter.
    tol = 2 ** -7 * b[fin].abs().max().item() + 1e-6
    assert (a[fin] - b[fin]).abs().max().item() <= tol
