"""kl_value on every MSA entry point (msa-semantics.md, "The KL value"), on the reference (CPU, float64):

- "exact": kl_loss and kl_metric hold the KL after the forward;
- "deferred": kl_loss's forward value is 0, the backward writes the exact KL into kl_metric; with no backward a given
  kl_metric makes the call "exact";
- "none": no value anywhere (kl_metric refused);
and the gradients are bitwise the same in every mode. tests/test_kl_value_gpu.py runs the same on the kernels."""

from __future__ import annotations

import pytest
import torch

import flash_msa_rt as F

B, S, H, Hk, Hp, Hpk, D = 1, 300, 8, 2, 2, 1, 16
TOP_K = 256  # K = 2 blocks of 128: a real selection over S = 300 (3 blocks)
LOSS_COEF = 0.3


def _inputs(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g, dtype=dtype) for h in (Hp, Hpk, H, Hk, Hk)]


def _fixed(fn):
    def call(ins, **kw):
        out, kl = fn(*ins, top_k=TOP_K, **kw)
        return out, kl
    return call


def _varlen(fn):
    cu = torch.tensor([0, 120, S], dtype=torch.int32)

    def call(ins, **kw):
        return fn(*(t[0].transpose(0, 1) for t in ins), cu, 180, TOP_K, **kw)  # (S, heads, D) views
    return call


ENTRY_POINTS = {"flash_msa_func": _fixed(F.flash_msa_func), "flash_msa_warmup_func": _fixed(F.flash_msa_warmup_func),
                "flash_msa_varlen_func": _varlen(F.flash_msa_varlen_func),
                "flash_msa_warmup_varlen_func": _varlen(F.flash_msa_warmup_varlen_func)}


def _train_step(call, ins, kl_value, metric):
    leaves = [t.clone().requires_grad_() for t in ins]
    out, kl = call(leaves, kl_value=kl_value, kl_metric=metric)
    forward_kl = kl.detach().clone()
    forward_metric = None if metric is None else metric.clone()
    g = torch.Generator().manual_seed(7)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().add(LOSS_COEF * kl).backward()
    return forward_kl, forward_metric, [t.grad for t in leaves]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_modes_share_gradients_and_the_deferred_value_arrives_in_the_backward(entry):
    call, ins = ENTRY_POINTS[entry], _inputs(0)
    exact_kl, exact_metric, exact_grads = _train_step(call, ins, "exact", torch.zeros((), dtype=torch.float32))
    assert exact_kl > 0 and exact_metric == exact_kl.float()

    metric = torch.zeros((), dtype=torch.float32)
    deferred_kl, before_backward, deferred_grads = _train_step(call, ins, "deferred", metric)
    assert deferred_kl == 0 and before_backward == 0, "deferred: the forward computes no KL value"
    assert metric == exact_metric, f"deferred KL {float(metric)} != exact {float(exact_metric)}"

    none_kl, _, none_grads = _train_step(call, ins, "none", None)
    assert none_kl == 0
    for name, e, d, n in zip(("q_proxy", "k_proxy", "q", "k", "v"), exact_grads, deferred_grads, none_grads):
        assert torch.equal(e, d), f"{entry} d{name}: deferred differs from exact"
        assert torch.equal(e, n), f"{entry} d{name}: none differs from exact"
        assert e.abs().sum() > 0, f"{entry} d{name} is zero: the comparison proves nothing"


@pytest.mark.parametrize("entry", ["flash_msa_func", "flash_msa_warmup_varlen_func"])
def test_deferred_without_a_backward_is_exact_when_a_metric_waits(entry):
    call, ins = ENTRY_POINTS[entry], _inputs(1)
    want = call(ins, kl_value="exact")[1]
    metric = torch.zeros((), dtype=torch.float32)
    with torch.no_grad():
        _, kl = call([t.clone().requires_grad_() for t in ins], kl_value="deferred", kl_metric=metric)
    assert kl == want and metric == want.float()
    _, kl = call(ins, kl_value="deferred", kl_metric=metric.zero_())  # no input needs a gradient
    assert kl == want and metric == want.float()
    _, kl = call(ins, kl_value="deferred")  # nobody asked for the value
    assert kl == 0


def test_deferred_metric_is_written_when_only_the_main_attention_trains():
    call, ins = ENTRY_POINTS["flash_msa_func"], _inputs(2)
    want = call(ins)[1]
    leaves = [t.clone().requires_grad_(i >= 2) for i, t in enumerate(ins)]  # q, k, v train; the proxy is frozen
    metric = torch.zeros((), dtype=torch.float32)
    out, kl = call(leaves, kl_value="deferred", kl_metric=metric)
    out.sum().backward()
    assert metric == want.float()
    assert leaves[0].grad is None and leaves[2].grad is not None


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_kl_value_errors_name_the_argument(entry):
    call, ins = ENTRY_POINTS[entry], _inputs(3, torch.float32)
    with pytest.raises(ValueError, match=r"kl_value='lazy' is not supported; expected one of exact, deferred, none"):
        call(ins, kl_value="lazy")
    with pytest.raises(ValueError, match=r"kl_value='none' computes no KL value, so kl_metric must be None"):
        call(ins, kl_value="none", kl_metric=torch.zeros(()))


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("route", ["backward", "forward"])
@pytest.mark.parametrize("kl_value", ["deferred", "none"])
def test_where_the_pass_runs_changes_no_value_and_no_gradient(route, kl_value, path, monkeypatch):
    """tuning.kl_value moves a small sparse step's KL pass into the forward (host-bound steps on the kernels): the
    contract is unchanged either way (kl_loss's forward value 0, kl_metric written by the backward with exact's
    value, exact's gradients bitwise), and the route taken is the one asked for (the backward's msa_kl op runs
    only on the backward route)."""
    from flash_msa_rt import tuning
    from flash_msa_rt.selftest import resolved_backends

    from flash_msa_rt.ops import eager

    if path == "custom_op":  # the torch.library custom ops (what torch.compile and export see)
        monkeypatch.setattr(eager, "usable", lambda *tensors: False)
    call, ins = ENTRY_POINTS["flash_msa_func"], _inputs(3)
    exact_kl, _, exact_grads = _train_step(call, ins, "exact", None)
    rows = {"backward": 0, "forward": 1 << 30}[route]
    metric = torch.zeros((), dtype=torch.float32) if kl_value == "deferred" else None
    with tuning.override(kl_value={"forward_pass_rows": rows, "forward_pass_devices": ("cpu", "cuda")}), \
            resolved_backends() as seen:
        kl, before_backward, grads = _train_step(call, ins, kl_value, metric)
    assert kl == 0 and (metric is None or before_backward == 0)
    assert ("msa_kl" in seen) == (route == "backward"), sorted(seen)
    if metric is not None:
        assert metric == exact_kl.float(), f"{route}: deferred KL {float(metric)} != exact {float(exact_kl)}"
    for name, e, g in zip(("q_proxy", "k_proxy", "q", "k", "v"), exact_grads, grads):
        assert torch.equal(e, g), f"{route} {kl_value} d{name} differs from exact"
