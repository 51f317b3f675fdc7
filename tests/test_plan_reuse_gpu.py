"""The MSA backward plans the forward's selection with the sorted lists the forward left on it
(sparse_plan.chunk_plans, keep_lists): one sort per step where the selection is small enough
(tuning.plan's keep_lists_entries), and the gradients of a step whose backward sorts again (H200)."""

from __future__ import annotations

import pytest
import torch

import flash_msa_rt as F

pytestmark = pytest.mark.gpu

B, S, H, Hk, Hp, Hpk, D = 1, 4100, 16, 4, 4, 1, 128  # G = 4, odd S: a partial last block
TOP_K = 1024


def _step(ins, dout, kl_value):
    leaves = [t.clone().requires_grad_() for t in ins]
    metric = torch.zeros((), device="cuda") if kl_value == "deferred" else None
    out, kl = F.flash_msa_func(*leaves, TOP_K, kl_metric=metric, kl_value=kl_value)
    ((out.float() * dout).sum() + 0.3 * kl).backward()
    torch.cuda.synchronize()
    return [t.grad for t in leaves] + ([metric] if metric is not None else [])


# The forward route (the KL pass in the forward, the backward's plan only) and the backward route (the proxy lse
# pass and the backward plan the selection after the forward): tuning.kl_value.
@pytest.mark.parametrize("kl_value, forward_pass_rows", [("exact", None), ("deferred", 1 << 30), ("deferred", 0)],
                         ids=("exact", "deferred-forward-route", "deferred-backward-route"))
def test_the_backward_takes_the_forwards_sorted_lists(launched_kernels, tuned, kl_value, forward_pass_rows):
    """One count-and-scatter sort per step (the forward's), the plans cut from it (two or three plan_items), and
    gradients and KL value bitwise equal (deterministic mode) to a step whose every plan sorts again."""
    if forward_pass_rows is not None:
        tuned(kl_value={"forward_pass_rows": forward_pass_rows})
    names = launched_kernels
    g = torch.Generator(device="cuda").manual_seed(11)
    ins = [torch.randn(B, h, S, D, device="cuda", generator=g).to(torch.bfloat16) for h in (Hp, Hpk, H, Hk, Hk)]
    dout = torch.randn(B, S, H * D, device="cuda", generator=g)  # flash_msa_func's out: (B, S, H * D)
    sorts = lambda: sum(n.startswith("plan_lists_") and "_phasecount_" in n for n in names)  # noqa: E731
    plans = lambda: sum(n.startswith("plan_items_") for n in names)  # noqa: E731
    torch.use_deterministic_algorithms(True)  # bitwise gradients
    try:
        kept = _step(ins, dout, kl_value)
        assert sorts() == 1 and plans() >= 2, names
        names.clear()
        tuned(plan={"keep_lists_entries": 0})
        again = _step(ins, dout, kl_value)
        assert sorts() == plans() >= 2, names
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(kept, again):
        assert torch.equal(a, b)
