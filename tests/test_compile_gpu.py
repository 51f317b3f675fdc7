"""torch.compile(mode="reduce-overhead") (CUDA graph trees) of a two-layer MSA training step on the kernels (H200):
several steps against eager, losses, KL metrics and gradients, in every kl_value mode and for a packed batch
(flash_msa_varlen_func: the offsets planned and checked on the device, bounded by max_seqlen).

The two layers are the ops themselves (layer 2's queries are layer 1's output), so every leaf's gradient has one
path and no reduction that inductor may order otherwise: gradients must equal eager bitwise in
deterministic mode; the loss (inductor's own sum) within rounding. CUDA graph trees refuse memory the forward
leaves outside the saved tensors ("tensors in the cudagraph pool not tracked as outputs", issue 52): the custom ops
keep no sorted lists on the selection (sparse_plan.ops_keep_no_lists)."""

from __future__ import annotations

import pytest
import torch

import flash_msa_rt as F

pytestmark = pytest.mark.gpu

S, H, Hk, Hp, Hpk, D = 2048, 4, 1, 1, 1, 128
TOP_K, STEPS, LR = 512, 4, 1e-2
CU = (0, 700, 2048)  # a packed batch of two sequences
MAX_SEQLEN = 1348


def _leaves(seed, packed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (lambda h: (S, h, D)) if packed else (lambda h: (1, S, h, D))
    layer = lambda: [torch.randn(shape(h), device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
                     for h in (Hp, Hpk, H, Hk, Hk)]
    return layer() + layer()[:2] + layer()[3:]  # layer 2: q comes from layer 1


def _attend(leaves, kl_value, metrics, cu):
    """Two MSA layers: layer 2's queries are layer 1's output. (out, kl1, kl2)."""
    m = metrics if kl_value != "none" else (None, None)
    kw = {"kl_value": kl_value}
    if cu is None:
        out1, kl1 = F.flash_msa_func(*leaves[:5], TOP_K, layout="bshd", kl_metric=m[0], **kw)
        q2 = out1.view(1, S, H, D)
        out2, kl2 = F.flash_msa_func(leaves[5], leaves[6], q2, leaves[7], leaves[8], TOP_K, layout="bshd",
                                     kl_metric=m[1], **kw)
    else:
        out1, kl1 = F.flash_msa_varlen_func(*leaves[:5], cu, MAX_SEQLEN, TOP_K, kl_metric=m[0], **kw)
        out2, kl2 = F.flash_msa_varlen_func(leaves[5], leaves[6], out1, leaves[7], leaves[8], cu, MAX_SEQLEN, TOP_K,
                                            kl_metric=m[1], **kw)
    return out2, kl1, kl2


def _train_step(leaves, dout, metrics, cu, kl_value):
    out, kl1, kl2 = _attend(leaves, kl_value, metrics, cu)
    loss = (out.float() * dout).sum() + 0.3 * kl1 + 0.7 * kl2
    loss.backward()
    return loss.detach()


def _train(step, kl_value, packed):
    """STEPS steps of SGD on the leaves: [(loss, metrics, grads)] per step, cloned (replays reuse their memory)."""
    leaves = [t.requires_grad_() for t in _leaves(21, packed)]
    g = torch.Generator(device="cuda").manual_seed(22)
    dout = torch.randn((S, H, D) if packed else (1, S, H * D), device="cuda", generator=g)
    metrics = tuple(torch.zeros((), device="cuda") for _ in range(2))
    for m in metrics:  # written in place by the graph: a static input, so CUDA graph trees keep the graph
        torch._dynamo.mark_static_address(m)
    cu = torch.tensor(CU, dtype=torch.int32, device="cuda") if packed else None
    history = []
    for _ in range(STEPS):
        loss = step(leaves, dout, metrics, cu, kl_value)
        history.append((loss.clone(), [m.clone() for m in metrics], [t.grad.clone() for t in leaves]))
        with torch.no_grad():
            for t in leaves:
                t -= LR * t.grad
                t.grad = None
    torch.cuda.synchronize()
    return history


@pytest.mark.parametrize("packed", [False, True], ids=("fixed", "packed"))
@pytest.mark.parametrize("kl_value", ["exact", "deferred", "none"])
def test_reduce_overhead_training_equals_eager(kl_value, packed):
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    torch.use_deterministic_algorithms(True, warn_only=True)  # the kernels' deterministic backward
    try:
        want = _train(_train_step, kl_value, packed)
        got = _train(torch.compile(_train_step, mode="reduce-overhead"), kl_value, packed)
    finally:
        torch.use_deterministic_algorithms(False)
    for step, ((loss, metrics, grads), (w_loss, w_metrics, w_grads)) in enumerate(zip(got, want)):
        torch.testing.assert_close(loss, w_loss, rtol=1e-5, atol=1e-3, msg=lambda m: f"step {step} loss: {m}")
        for n, (a, b) in enumerate(zip(metrics, w_metrics)):  # inductor forms the mean its own way: one ulp
            torch.testing.assert_close(a, b, rtol=2e-7, atol=0, msg=lambda m: f"step {step}: kl_metric {n}: {m}")
        for n, (a, b) in enumerate(zip(grads, w_grads)):
            assert torch.equal(a, b), f"step {step}: gradient of leaf {n} differs from eager by " \
                                      f"{(a.float() - b.float()).abs().max().item()}"
    if kl_value != "none":
        assert all(m > 0 for m in got[-1][1])
    skips = dict(counters["inductor"])
    assert not any("cudagraph_skips" in k for k in skips), f"CUDA graphs skipped: {skips}"


@pytest.mark.parametrize("kl_value", ["exact", "deferred"])
def test_reduce_overhead_with_sinks_equals_eager(kl_value):
    """Attention sinks under reduce-overhead: the sink step's custom ops (flash_msa_rt.ops.library.sink_rows) and the
    combine's sink variant inside CUDA graph trees, several SGD steps on the inputs and the sinks against eager.
    The five inputs' gradients bitwise (deterministic backward); d sinks is a sum over rows that inductor may order
    its own way: within float32 rounding."""
    def step(leaves, sinks, dout, metric):
        out, kl = F.flash_msa_func(*leaves, TOP_K, layout="bshd", kl_value=kl_value, kl_metric=metric, sinks=sinks)
        loss = (out.float() * dout).sum() + 0.3 * kl
        loss.backward()
        return loss.detach()

    def train(fn):
        leaves = [t.requires_grad_() for t in _leaves(31, False)[:5]]
        sinks = torch.linspace(-1.0, 2.0, H, device="cuda").requires_grad_()
        dout = torch.randn((1, S, H * D), device="cuda", generator=torch.Generator(device="cuda").manual_seed(32))
        metric = torch.zeros((), device="cuda")
        torch._dynamo.mark_static_address(metric)
        history = []
        for _ in range(STEPS):
            loss = fn(leaves, sinks, dout, metric)
            history.append((loss.clone(), metric.clone(), [t.grad.clone() for t in leaves], sinks.grad.clone()))
            with torch.no_grad():
                for t in leaves + [sinks]:
                    t -= LR * t.grad
                    t.grad = None
        torch.cuda.synchronize()
        return history

    torch._dynamo.reset()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        want = train(step)
        got = train(torch.compile(step, mode="reduce-overhead"))
    finally:
        torch.use_deterministic_algorithms(False)
    for n, ((loss, metric, grads, d_sinks), (w_loss, w_metric, w_grads, w_d_sinks)) in enumerate(zip(got, want)):
        torch.testing.assert_close(loss, w_loss, rtol=1e-5, atol=1e-3, msg=lambda m: f"step {n} loss: {m}")
        torch.testing.assert_close(metric, w_metric, rtol=2e-7, atol=0, msg=lambda m: f"step {n} kl_metric: {m}")
        for i, (a, b) in enumerate(zip(grads, w_grads)):
            assert torch.equal(a, b), f"step {n}: gradient of input {i} differs from eager"
        torch.testing.assert_close(d_sinks, w_d_sinks, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {n} d sinks: {m}")
    assert got[-1][3].abs().sum() > 0
