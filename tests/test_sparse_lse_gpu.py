"""The sparse proxy lse alone (kernels_src/sparse_kl/lse.py, msa_kl_cuda with_kl=False) on the H200: lse_proxy
bit for bit the KL pass's over the same selection (same product, same row statistics, same merge), at every G
(the pass's resident and streamed schedules), bf16 and fp16, odd S, keys longer than queries; the kernel is the
one that ran; NaN reaches exactly the rows whose scores see it; and the "none" / metric-less "deferred" modes,
which run it in their backward, keep exact mode's gradients bit for bit (deterministic)."""

import pytest
import torch

pytestmark = pytest.mark.gpu  # conftest skips it without a usable GPU (fails under FLASH_MSA_REQUIRE_GPU=1)

BS = 128
# (B, S, Sk, H, Hk, Hp, Hpk, top_k blocks)
SHAPES = [
    (1, 1, 1, 4, 1, 4, 1, 4),
    (2, 333, 333, 8, 2, 8, 1, 2),  # G = 1
    (1, 1537, 1537, 16, 4, 8, 2, 4),  # G = 2
    (2, 2049, 2049, 16, 4, 4, 1, 8),  # G = 4
    (1, 1200, 3000, 16, 2, 4, 1, 6),  # keys longer than queries (a chunk against its prefix)
    (1, 2300, 2300, 32, 4, 4, 1, 5),  # G = 8: the streamed KL pass
    (1, 900, 900, 32, 2, 2, 1, 3),  # G = 16
]


def _inputs(B, S, Sk, H, Hk, Hp, Hpk, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    return rnd(B, S, Hp, 128), rnd(B, Sk, Hpk, 128), rnd(B, S, H, 128), rnd(B, Sk, Hk, 128), rnd(B, Sk, Hk, 128)


def _selection(qp, kp, K, scale):
    from flash_msa_rt.ops.select import select_blocks_cuda

    return select_blocks_cuda(qp, kp, K, BS, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_lse_alone_is_the_kl_pass_lse(shape, dtype):
    from flash_msa_rt.ops import sparse_fwd

    B, S, Sk, H, Hk, Hp, Hpk, K = shape
    qp, kp, q, k, v = _inputs(B, S, Sk, H, Hk, Hp, Hpk, dtype, seed=S)
    scale = 128 ** -0.5
    sel = _selection(qp, kp, K, scale)
    lse = torch.randn(B, H, S, device="cuda") + 5.0  # any main lse: lse_proxy does not read it
    launched = []
    real = sparse_fwd.get_kernel

    def spy(op, config, dev):
        launched.append((op, config.get("kl_value")))
        return real(op, config, dev)

    sparse_fwd.get_kernel = spy
    try:
        lse_p, kl_rows = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, BS, scale, with_kl=False)
    finally:
        sparse_fwd.get_kernel = real
    want_p, want_kl = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, BS, scale)
    assert ("sparse_kl", 0) in launched and ("sparse_kl", 1) not in launched, launched
    assert torch.equal(lse_p, want_p), (lse_p - want_p).abs().max().item()
    assert torch.isfinite(lse_p).all()
    assert torch.equal(kl_rows, torch.zeros_like(kl_rows))
    assert want_kl.abs().sum() > 0  # the pass itself formed a KL value: the comparison above is not vacuous


def test_nan_reaches_exactly_the_rows_that_see_it():
    """A NaN in one key of k_proxy: lse_proxy is NaN in the rows whose selected blocks hold that key and only
    there, as the KL pass's."""
    from flash_msa_rt.ops import sparse_fwd

    B, S, H, Hk, Hp, Hpk, K = 1, 1000, 8, 2, 4, 1, 3
    qp, kp, q, k, v = _inputs(B, S, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=3)
    scale = 128 ** -0.5
    sel = _selection(qp, kp, K, scale)
    kp[0, 300, 0, 5] = float("nan")
    lse = torch.zeros(B, H, S, device="cuda")
    lse_p, _ = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, BS, scale, with_kl=False)
    want_p, _ = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, BS, scale)
    sees = (sel == 300 // BS).any(-1) & (torch.arange(S, device="cuda") >= 300)
    assert torch.equal(torch.isnan(lse_p), sees)
    assert torch.equal(torch.isnan(want_p), sees)
    assert torch.equal(lse_p[~sees], want_p[~sees])


@pytest.mark.parametrize("mode", ["none", "deferred"])
def test_modes_without_a_value_keep_exact_gradients(mode):
    """msa_func's "none" and metric-less "deferred" backward take lse_proxy from the proxy lse alone; with
    deterministic algorithms their gradients are exact mode's bit for bit."""
    import flash_msa_rt
    from flash_msa_rt import tuning
    from flash_msa_rt.ops import sparse_fwd

    B, S, H, Hk, Hp, Hpk, K = 1, 2048, 16, 4, 4, 1, 8
    grads, launched = {}, []
    real = sparse_fwd.get_kernel

    def spy(op, config, dev):
        launched.append((op, config.get("kl_value")))
        return real(op, config, dev)

    torch.use_deterministic_algorithms(True)
    sparse_fwd.get_kernel = spy
    try:
        # the backward's route (a step this small would otherwise run the pass in the forward: tuning.kl_value)
        with tuning.override(kl_value={"forward_pass_rows": 0}):
            for kl_value in ("exact", mode):
                launched.clear()
                qp, kp, q, k, v = (t.requires_grad_() for t in _inputs(B, S, S, H, Hk, Hp, Hpk, torch.bfloat16, 7))
                out, kl_loss = flash_msa_rt.flash_msa_func(qp, kp, q, k, v, top_k=K * BS, layout="bshd",
                                                           kl_value=kl_value)
                torch.autograd.backward((out, kl_loss), (torch.ones_like(out) * 1e-2, torch.ones_like(kl_loss)))
                grads[kl_value] = [t.grad for t in (qp, kp, q, k, v)]
                assert (("sparse_kl", 0) in launched) == (kl_value != "exact"), (kl_value, launched)
                assert (("sparse_kl", 1) in launched) == (kl_value == "exact"), (kl_value, launched)
    finally:
        sparse_fwd.get_kernel = real
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), grads["exact"], grads[mode]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("with_kl", [False, True])
def test_one_head_at_a_time_past_max_cells_is_bitwise_the_whole(with_kl, tuned):
    """Past the plan kernels' max_cells for all heads at once, msa_kl_cuda runs chunks of one proxy head on
    head-sliced views, each sorted by itself: lse_proxy and kl_rows bit for bit those of one chunk of every head."""
    from flash_msa_rt.ops import sparse_fwd, sparse_plan as sp

    B, S, H, Hk, Hp, Hpk, K = 2, 3000, 16, 4, 4, 1, 6
    qp, kp, q, k, v = _inputs(B, S, S, H, Hk, Hp, Hpk, torch.bfloat16, seed=41)
    scale = 128 ** -0.5
    sel = _selection(qp, kp, K, scale)
    lse = torch.randn(B, H, S, device="cuda") + 5.0
    want_p, want_kl = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, BS, scale, with_kl=with_kl)
    tuned(plan={"max_cells": sp.chunk_keys(B, 1, S, K, 1, S, BS).cells})
    assert sparse_fwd.sorted_heads(sel, BS, H // Hp, S, Hk, Hpk) == 1
    lse_p, kl_rows = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, BS, scale, with_kl=with_kl)
    assert torch.equal(lse_p, want_p) and torch.equal(kl_rows, want_kl)
    assert not with_kl or want_kl.abs().sum() > 0
