"""Context parallelism's per-rank compute without communication (flash_msa_rt.distributed.attention.rank_attention):
each of N simulated ranks runs its zigzag query shards against the whole sequence's keys on one device, and the
ranks' outputs put back in sequence order, their query gradients, and their key gradients summed over the ranks
(what the gather's backward does) must equal the full single-process op. On CPU here; on the GPU (one H200 stands
in for the ranks) the same check runs as a gpu test, on whatever backend the varlen call with separate key offsets
takes there (float32: the reference; bf16: the kernels, bitwise for the outputs)."""

import pytest
import torch

import flash_msa_rt as F
from flash_msa_rt.distributed import shard_spans
from flash_msa_rt.distributed.sharding import pack_spans, pack_starts
from flash_msa_rt.distributed.attention import rank_attention

B, S, H, Hk, Hp, Hpk, D, TOP_K, WORLD = 1, 777, 4, 2, 2, 1, 32, 256, 4


def _inputs(device, dtype):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, S, h, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
            for h in (Hp, Hpk, H, Hk, Hk)]


def _rows(x, spans):
    return torch.cat([x[:, a:b] for a, b in spans], dim=1)


PACK = [300, 5, 0, 200, 272]  # sequences of a packed row (B = 1, S tokens): one shorter than 2N chunks, one empty


def _check(device, dtype, sparse, precision, tol, packed=False):
    full = [t.detach().requires_grad_() for t in _inputs(device, dtype)]
    fn = F.flash_msa_func if sparse else F.flash_msa_warmup_func
    kwargs = {"select_precision": precision} if sparse else {}
    bounds = [0, *torch.tensor(PACK).cumsum(0).tolist()] if packed else None
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=device)
    out, kl = fn(*full, TOP_K, layout="bshd", **kwargs, **({"cu_seqlens": cu} if packed else {}))
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    ((out.float() * dout.float()).sum() + kl).backward()

    key_grads = [torch.zeros_like(t, dtype=torch.float64) for t in full[1:2] + full[3:]]
    for r in range(WORLD):
        spans = pack_spans(bounds, WORLD, r) if packed else shard_spans(S, WORLD, r, "zigzag")
        L = sum(b - a for a, b in spans)
        qp, q = (_rows(t.detach(), spans).requires_grad_() for t in (full[0], full[2]))
        kp, k, v = (t.detach().requires_grad_() for t in (full[1], full[3], full[4]))
        o, kl_r = rank_attention(sparse, qp, kp, q, k, v, spans, TOP_K, block_size=128, **kwargs,
                                 starts=pack_starts(bounds) if packed else None)
        torch.testing.assert_close(o.reshape(B, L, -1), _rows(out.detach(), spans), **tol)
        # this rank's share of the whole mean: its rows' KL weighted by L / S
        ((o.float() * _rows(dout, spans).reshape(o.shape).float()).sum() + kl_r * (L / S)).backward()
        torch.testing.assert_close(qp.grad, _rows(full[0].grad, spans), **tol)
        torch.testing.assert_close(q.grad, _rows(full[2].grad, spans), **tol)
        for acc, t in zip(key_grads, (kp, k, v)):
            acc += t.grad.double()
    for acc, want in zip(key_grads, (full[1].grad, full[3].grad, full[4].grad)):
        torch.testing.assert_close(acc.to(want.dtype), want, **tol)


@pytest.mark.parametrize("sparse,precision", [(True, "bf16"), (True, "fp8"), (False, "bf16")],
                         ids=["msa", "msa-fp8", "warmup"])
def test_simulated_ranks_equal_the_full_op(sparse, precision):
    _check("cpu", torch.float64, sparse, precision, dict(rtol=1e-9, atol=1e-10))


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "warmup"])
def test_simulated_ranks_of_a_pack_equal_the_full_packed_op(sparse):
    """A packed row (cu_seqlens): each sequence split over the ranks on its own, a chunk's keys its own
    sequence's prefix; the ranks together equal flash_msa_func(..., cu_seqlens=)."""
    _check("cpu", torch.float64, sparse, "bf16", dict(rtol=1e-9, atol=1e-10), packed=True)


@pytest.mark.gpu
@pytest.mark.allow_reference  # float32: the reference on both sides (the kernels take bf16 / fp16)
@pytest.mark.parametrize("sparse,precision", [(True, "bf16"), (True, "fp8"), (False, "bf16")],
                         ids=["msa", "msa-fp8", "warmup"])
def test_simulated_ranks_on_one_gpu_equal_the_full_op(sparse, precision):
    """float32 on the GPU: the full op and the ranks take one backend, so no near tie can select different blocks
    on the two sides (bf16 joins when the per-rank call runs on the kernels as the full op does)."""
    _check("cuda", torch.float32, sparse, precision, dict(rtol=1e-4, atol=1e-5))


@pytest.mark.gpu
def test_simulated_ranks_on_the_kernels_compute_their_rows_of_the_full_op():
    """bf16 at D = 128, where the full op and every rank's varlen call (separate key offsets) run on the kernels:
    each rank's output is its rows of the full op's, bit for bit (a row depends on its own query and the keys, and
    the kernels place a chunk's rows at their key positions); the gradients agree to bf16's rounding (the key
    gradients are summed over the ranks, the query gradients' atomics run in another order). The summed key
    gradients are N bf16-rounded partials against one rounded total: each element within the partials' roundings
    and the total's (plus fp32 summation order), not within one rounding of the total (at 866a495's GPU run:
    4.7 % of dk's elements past torch's bf16 defaults)."""
    from flash_msa_rt.selftest import on_kernels, resolved_backends

    S2, H2, Hk2, Hp2, Hpk2, D2, world = 1000, 8, 2, 2, 1, 128, 4
    g = torch.Generator(device="cuda").manual_seed(5)
    full = [torch.randn(1, S2, h, D2, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
            for h in (Hp2, Hpk2, H2, Hk2, Hk2)]
    dout = torch.randn(1, S2, H2 * D2, device="cuda", generator=g).to(torch.bfloat16)
    tol = dict(rtol=1.6e-2, atol=1e-5)  # torch's bf16 defaults: one rounding of the same fp32 sums
    with resolved_backends() as seen:
        out, kl = F.flash_msa_func(*full, TOP_K, layout="bshd")
        ((out.float() * dout.float()).sum() + kl).backward()
        key_grads = [torch.zeros_like(t, dtype=torch.float64) for t in full[1:2] + full[3:]]
        key_mags = [torch.zeros_like(t, dtype=torch.float64) for t in full[1:2] + full[3:]]
        kl_sum = 0.0
        for r in range(world):
            spans = shard_spans(S2, world, r, "zigzag")
            L = sum(b - a for a, b in spans)
            qp, q = (_rows(t.detach(), spans).requires_grad_() for t in (full[0], full[2]))
            kp, k, v = (t.detach().requires_grad_() for t in (full[1], full[3], full[4]))
            o, kl_r = rank_attention(True, qp, kp, q, k, v, spans, TOP_K, block_size=128)
            assert torch.equal(o.reshape(1, L, -1), _rows(out.detach(), spans)), f"rank {r}: output rows differ"
            ((o.float() * _rows(dout, spans).reshape(o.shape).float()).sum() + kl_r * (L / S2)).backward()
            kl_sum += float(kl_r) * L / S2
            torch.testing.assert_close(qp.grad, _rows(full[0].grad, spans), **tol)
            torch.testing.assert_close(q.grad, _rows(full[2].grad, spans), **tol)
            for acc, mag, t in zip(key_grads, key_mags, (kp, k, v)):
                acc += t.grad.double()
                mag += t.grad.double().abs()
    assert on_kernels(seen, ("select_blocks", "msa_forward", "msa_backward")) is None, seen
    torch.testing.assert_close(kl_sum, float(kl), rtol=1e-5, atol=1e-7)
    u = 2.0 ** -8  # bf16's unit roundoff
    for name, acc, mag, want in zip(("dk_proxy", "dk", "dv"), key_grads, key_mags,
                                    (full[1].grad, full[3].grad, full[4].grad)):
        w = want.double()
        # A rank's key gradient is rounded twice where its two zigzag chunks' keys overlap (each chunk call's bf16
        # gradient, then their fp32 sum: packed._summed_key_results), the full op's once; plus the fp32 atomics'
        # order, relative to the contributions' magnitudes (which cancel in dk_proxy's (pi - tau) terms and which
        # the test does not see): 0.1 % of the gradient's scale. A misplaced key range costs ~100 % of it.
        bound = 2 * u * mag + u * w.abs() + 1e-3 * w.abs().max()
        excess = ((acc - w).abs() - bound).max().item()
        assert excess <= 0, f"{name}: the ranks' sum is {excess:.3g} past bf16's rounding of its partials"
