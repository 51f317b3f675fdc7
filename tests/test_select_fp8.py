"""fp8 selection (select_precision="fp8") on the reference: the quantisation's contract and the selection it gives,
any machine (docs/msa-semantics.md, "FP8 selection")."""

import pytest
import torch

import flash_msa_rt as fm
from flash_msa_rt.reference import fp8
from flash_msa_rt.reference.selection import select_blocks


def dequantized(q_proxy, k_proxy, block_size):
    """The values fp8 selection ranks with, as float32 inputs: e4m3 times a power of two, exact in float32."""
    q8, sq = fp8.quantize_rows(q_proxy)
    k8, sk = fp8.quantize_key_blocks(k_proxy, block_size)
    S = k_proxy.shape[1]
    return q8.float() * sq[..., None], k8.float() * sk.repeat_interleave(block_size, dim=1)[:, :S, :, None]


def test_power_of_two_scale_is_the_smallest_that_fits():
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.exp(torch.randn(10000, generator=g) * 20).float(),
                      torch.tensor([448.0, 448.00003, 224.0, 392.0, 392.00003, 1.0, 2.0 ** -130, 3.0e38])])
    s = fp8.power_of_two_scale(amax)
    mantissa, _ = torch.frexp(s)
    assert (mantissa == 0.5).all(), "scales are powers of two"
    assert (amax / s <= 448).all(), "amax fits"
    floor = s == 2.0 ** -126  # the floor keeps 1 / s finite in bfloat16
    assert ((amax / (s / 2) > 448) | floor).all(), "the smallest power of two that fits"
    assert floor[-2] and (1 / s).isfinite().all()
    special = fp8.power_of_two_scale(torch.tensor([0.0, float("nan"), float("inf")]))
    assert special[0] == 1 and torch.isnan(special[1]) and torch.isinf(special[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantisation_rounds_once(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 333, 3, 64, generator=g) * torch.rand(2, 333, 3, 1, generator=g) * 50).to(dtype)
    q8, sq = fp8.quantize_rows(x)
    assert q8.dtype == torch.float8_e4m3fn and sq.shape == (2, 333, 3) and sq.dtype == torch.float32
    want = (x.double() / sq[..., None].double()).to(torch.float8_e4m3fn)  # exact division, one rounding
    assert torch.equal(q8.view(torch.uint8), want.view(torch.uint8))
    assert (q8.float().abs().amax(-1) >= 224).all(), "every row uses the top binade of e4m3"
    k8, sk = fp8.quantize_key_blocks(x, 128)
    assert sk.shape == (2, 3, 3) and sk.is_contiguous()
    for j, (a, b) in enumerate(((0, 128), (128, 256), (256, 333))):  # the last block is partial
        assert torch.equal(sk[:, j], fp8.power_of_two_scale(x[:, a:b].double().abs().amax(dim=(1, 3))))
    want_k = (x.double() / sk.repeat_interleave(128, dim=1)[:, :333, :, None].double()).to(torch.float8_e4m3fn)
    assert torch.equal(k8.view(torch.uint8), want_k.view(torch.uint8))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 700, 4, 2, 3), (1, 1029, 8, 1, 6), (1, 300, 2, 1, 40)])
def test_fp8_selection_is_the_contract_on_the_dequantised_inputs(shape):
    """Ranking by scale * s_q * s_k * <q8, k8> is ranking the dequantised inputs' scores: powers of two make every
    scale product exact, so the two selections are equal row for row, ties included."""
    B, S, Hp, Hpk, K = shape
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, S, Hp, 64, generator=g).to(torch.bfloat16)
    k = (torch.randn(B, S, Hpk, 64, generator=g) * torch.rand(B, S, Hpk, 1, generator=g) * 4).to(torch.bfloat16)
    qd, kd = dequantized(q, k, 64)
    got = select_blocks(q, k, K, 64, 0.125, "fp8")
    assert torch.equal(got, select_blocks(qd, kd, K, 64, 0.125))


def test_fp8_selection_ranks_near_the_unquantised_one():
    """A smoke bound on random inputs (the trained-proxy recall is measured on the GPU): most rows keep the same set."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2048, 2, 64, generator=g), torch.randn(1, 2048, 1, 64, generator=g)
    a, b = select_blocks(q, k, 4, 64, 0.125), select_blocks(q, k, 4, 64, 0.125, "fp8")
    same = (a.sort(-1).values == b.sort(-1).values).all(-1).double().mean().item()
    assert 0.6 < same < 1.0, same  # close, yet not identical: the quantisation is really applied


def test_public_api_passes_select_precision():
    g = torch.Generator().manual_seed(2)
    B, S, H, Hp, D = 1, 400, 4, 2, 64
    qp, kp = torch.randn(B, Hp, S, D, generator=g), torch.randn(B, 1, S, D, generator=g)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (H, 2, 2))
    want = select_blocks(qp.transpose(1, 2), kp.transpose(1, 2), 3, 64, D ** -0.5, "fp8")
    assert torch.equal(fm.select_blocks(qp, kp, 192, block_size=64, select_precision="fp8"), want)
    out, kl = fm.flash_msa_func(qp, kp, q, k, v, 192, block_size=64, select_precision="fp8")
    ref = fm.block_sparse_attention(q, k, v, want.repeat_interleave(H // Hp, dim=1), block_size=64)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(B, S, H * D), rtol=1e-5, atol=1e-5)
    cu = torch.tensor([0, 150, 400], dtype=torch.int32)
    out_v, _ = fm.flash_msa_varlen_func(qp[0].transpose(0, 1), kp[0].transpose(0, 1), q[0].transpose(0, 1),
                                        k[0].transpose(0, 1), v[0].transpose(0, 1), cu, 250, 192, block_size=64,
                                        select_precision="fp8")
    first, _ = fm.flash_msa_func(qp[:, :, :150], kp[:, :, :150], q[:, :, :150], k[:, :, :150], v[:, :, :150], 192,
                                 block_size=64, select_precision="fp8")
    torch.testing.assert_close(out_v[:150].reshape(1, 150, -1), first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["fp4", "FP8", None, 8])
def test_bad_select_precision_names_the_argument(bad):
    qp = torch.randn(1, 2, 64, 32)
    kp = torch.randn(1, 1, 64, 32)
    q, k, v = torch.randn(1, 2, 64, 32), torch.randn(1, 1, 64, 32), torch.randn(1, 1, 64, 32)
    for call in (lambda: fm.select_blocks(qp, kp, 128, select_precision=bad),
                 lambda: fm.flash_msa_func(qp, kp, q, k, v, 128, select_precision=bad)):
        with pytest.raises(ValueError, match=r"select_precision=.*expected one of bf16, fp8"):
            call()


def test_warmup_takes_no_select_precision():
    """Warmup selects nothing: its entry points refuse the argument rather than ignore it."""
    t = torch.randn(1, 1, 64, 32)
    with pytest.raises(TypeError, match="select_precision"):
        fm.flash_msa_warmup_func(t, t, t, t, t, 128, select_precision="fp8")
