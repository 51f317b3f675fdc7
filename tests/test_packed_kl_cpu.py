"""The deferred KL value of a pack (flash_msa_rt.ops.packed_kl.PackKL): the backward's calls hand their KL rows back
and kl_metric becomes the mean over the pack's real rows, whether the pack runs as runs of equal lengths, padded
buckets or one batch planned on the device; a padded row's value (NaN here) never reaches it. On the CPU with a
stand-in for the kernels' backward, so the bookkeeping is checked where CI runs (the kernels' own rows:
tests/test_packed_gpu.py)."""

from __future__ import annotations

import math

import pytest
import torch

from flash_msa_rt.ops import offsets, packed

HP, DP, H, D, K = 2, 8, 4, 8, 2


def _standin_backward(calls):
    """msa_backward's signature; its KL rows are each row's q_proxy sum, NaN where the row selects nothing (the
    padding), and it counts its calls."""

    def impl(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out, kl_grad,
             cu_seqlens=None, kl_metric=None, kl_rows_out=None, proxy_scale=None):
        assert cu_seqlens is None and kl_metric is None and kl_rows_out is not None
        calls.append(q_proxy.shape[:2])
        rows = q_proxy.double().sum(-1).transpose(1, 2)  # (count, Hp, length)
        kl_rows_out.append(torch.where(block_indices[..., 0] < 0, math.nan, rows))
        return tuple(torch.zeros_like(t) for t in (q_proxy, k_proxy, q, k, v))

    return impl


def _pack(lengths, seed=0):
    total = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    q_proxy = torch.randn(1, total, HP, DP, generator=g, dtype=torch.float64)
    tokens = [torch.zeros(1, total, h, d, dtype=torch.float64) for h, d in ((1, DP), (H, D), (1, D), (1, D), (H, D))]
    lse = torch.zeros(1, H, total, dtype=torch.float64)
    block_indices = torch.zeros(1, HP, total, K, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    args = [q_proxy, tokens[0], *tokens[1:4], tokens[4], lse, lse.clone(), block_indices, 128, 0.1,
            torch.zeros(1, total, H, D, dtype=torch.float64), None, cu]
    return args, q_proxy[0].sum(-1).mean()


@pytest.mark.parametrize("lengths", [[700], [300, 300, 300], [300, 200, 130, 512, 1]],
                         ids=["one", "a run", "runs and a padded bucket"])
def test_the_metric_is_the_mean_over_the_packs_real_rows(lengths):
    calls = []
    run = packed.per_sequence("msa_backward", _standin_backward(calls), lambda *a, **k: pytest.fail("fallback"))
    args, want = _pack(lengths)
    metric = torch.zeros((), dtype=torch.float64)
    run(*args, kl_metric=metric)
    assert calls, "the stand-in ran"
    torch.testing.assert_close(metric, want, rtol=1e-12, atol=0)


def test_the_device_plan_masks_its_padded_rows():
    calls = []
    run = packed.per_sequence("msa_backward", _standin_backward(calls), lambda *a, **k: pytest.fail("fallback"))
    lengths = [300, 200, 130]
    args, want = _pack(lengths, seed=1)
    metric = torch.zeros((), dtype=torch.float64)
    with offsets.planned_with(max(lengths)):
        run(*args, kl_metric=metric)
    assert calls == [(len(lengths), 384)], "one batch, every sequence padded to the bound"
    torch.testing.assert_close(metric, want, rtol=1e-12, atol=0)


def test_a_nan_in_a_real_row_reaches_the_metric():
    run = packed.per_sequence("msa_backward", _standin_backward([]), lambda *a, **k: pytest.fail("fallback"))
    args, _ = _pack([300, 200, 130])
    args[0][0, 310, 1, 0] = math.nan
    metric = torch.zeros((), dtype=torch.float64)
    run(*args, kl_metric=metric)
    assert metric.isnan()


def test_without_a_metric_the_calls_take_no_rows_sink():
    seen = []

    def impl(*a, **kw):
        seen.append(kw)
        return tuple(torch.zeros_like(t) for t in a[:5])

    args, _ = _pack([300, 200])
    packed.per_sequence("msa_backward", impl, lambda *a, **k: pytest.fail("fallback"))(*args)
    assert seen and all("kl_rows_out" not in kw for kw in seen)


def test_separate_key_offsets_average_over_the_query_rows():
    """cu_seqlens_k: each query sequence is its own call against its keys; the metric is over the query rows."""
    calls = []
    run = packed.per_sequence("msa_backward", _standin_backward(calls), lambda *a, **k: pytest.fail("fallback"))
    q_lengths, k_lengths = [200, 130], [300, 130]
    args, want = _pack(q_lengths, seed=2)
    total_k = sum(k_lengths)
    for i in (1, 3, 4):  # k_proxy, k, v on the keys' tokens
        args[i] = torch.zeros(1, total_k, *args[i].shape[2:], dtype=torch.float64)
    cu_k = torch.tensor([0, *torch.tensor(k_lengths).cumsum(0).tolist()], dtype=torch.int32)
    metric = torch.zeros((), dtype=torch.float64)
    run(*args, kl_metric=metric, cu_seqlens_k=cu_k)
    assert len(calls) == 2
    torch.testing.assert_close(metric, want, rtol=1e-12, atol=0)
