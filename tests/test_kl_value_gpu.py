"""kl_value on the kernels (H200): "deferred" and "none" forwards skip the KL pass, the backward runs it (msa_kl,
warmup_kl) on the same lse with the same kernels, so the deferred value equals the exact one (target: within 1e-3
relative; the same launches make it bitwise) and the gradients are bitwise equal across the three modes in
deterministic mode (sparse MSA: its deterministic kernels; warmup: its backward declines deterministic mode and runs
the reference, still bitwise across modes). tests/test_kl_value.py holds the same contract on the reference."""

from __future__ import annotations

import pytest
import torch

import flash_msa_rt as F
from flash_msa_rt.selftest import on_kernels, resolved_backends

pytestmark = pytest.mark.gpu

B, S, H, Hk, Hp, Hpk, D = 1, 4100, 16, 4, 4, 1, 128  # G = 4, odd S: a partial last block
TOP_K = 1024


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, h, S, D, device="cuda", generator=g).to(torch.bfloat16) for h in (Hp, Hpk, H, Hk, Hk)]


def _step(fn, ins, kl_value, metric, dout):
    leaves = [t.clone().requires_grad_() for t in ins]
    with resolved_backends() as seen:
        out, kl = fn(*leaves, TOP_K, kl_metric=metric, kl_value=kl_value)
        forward_kl = kl.detach().clone()
        ((out.float() * dout).sum() + 0.3 * kl).backward()
    torch.cuda.synchronize()
    return forward_kl, [t.grad for t in leaves], seen


@pytest.mark.parametrize("route", ["backward", "forward"])  # tuning.kl_value: where a sparse step's KL pass runs
@pytest.mark.parametrize("entry, deterministic", [
    ("flash_msa_func", False), ("flash_msa_func", True), ("flash_msa_warmup_func", False),
    # warmup's backward has no deterministic kernels: dispatch runs the reference there (and says so)
    pytest.param("flash_msa_warmup_func", True, marks=pytest.mark.allow_reference)],
    ids=["msa-atomics", "msa-deterministic", "warmup-atomics", "warmup-deterministic"])
def test_deferred_value_and_gradients_match_exact_on_the_kernels(entry, deterministic, route, tuned):
    tuned(kl_value={"forward_pass_rows": 0 if route == "backward" else 1 << 30})
    fn = getattr(F, entry)
    ins = _inputs(0)
    dout = torch.randn(B, S, H * D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        exact_metric = torch.zeros((), device="cuda")
        exact_kl, exact_grads, seen = _step(fn, ins, "exact", exact_metric, dout)
        deferred_metric = torch.zeros((), device="cuda")
        deferred_kl, deferred_grads, seen_d = _step(fn, ins, "deferred", deferred_metric, dout)
        none_kl, none_grads, _ = _step(fn, ins, "none", None, dout)
    finally:
        torch.use_deterministic_algorithms(before)
    forward_op = "msa_forward" if entry == "flash_msa_func" else "warmup_forward"
    kl_op = forward_op.replace("forward", "kl")
    assert on_kernels(seen, (forward_op,)) is None, seen
    # the backward's KL pass runs in warmup (its own scheme) and on a sparse step's backward route
    backward_pass = entry != "flash_msa_func" or route == "backward"
    assert on_kernels(seen_d, (forward_op, kl_op) if backward_pass else (forward_op,)) is None, seen_d
    assert (kl_op in seen_d) == backward_pass, seen_d
    assert deferred_kl == 0 and none_kl == 0
    rel = abs(float(deferred_metric) - float(exact_kl)) / abs(float(exact_kl))
    print(f"\n{entry} deterministic={deterministic}: exact KL {float(exact_kl):.6f}, deferred "
          f"{float(deferred_metric):.6f} (relative difference {rel:.2e}; target <= 1e-3)")
    assert float(exact_kl) > 0 and rel <= 1e-3
    for name, e, d, n in zip(("q_proxy", "k_proxy", "q", "k", "v"), exact_grads, deferred_grads, none_grads):
        if deterministic:
            assert torch.equal(e, d) and torch.equal(e, n), f"{entry} d{name}: modes differ in deterministic mode"
        else:  # fp32 atomics: equal up to their summation order
            for other in (d, n):
                torch.testing.assert_close(other.float(), e.float(), rtol=2e-2, atol=2e-2 * e.float().abs().max())


@pytest.mark.parametrize("kl_value, metric, want, not_want", [
    ("deferred", True, ("warmup_kl_", "_kl0_"), ("warmup_kl_", "_kl1_")),
    ("none", False, ("warmup_kl_", "_kl0_"), ("warmup_kl_", "_kl1_")),
    ("exact", False, ("warmup_kl_", "_kl1_"), ("warmup_kl_", "_kl0_"))], ids=("deferred", "none", "exact"))
def test_warmup_deferred_runs_the_proxy_lse_alone(launched_kernels, kl_value, metric, want, not_want):
    """Where the proxy gradient needs lse_proxy and the KL value (if any) can come from the backward (G <= 4),
    deferred and none modes run the proxy lse alone (warmup_kl kl_value = 0), not the KL pass, and deferred's
    proxy backward is the kl_value = 1 variant; exact mode keeps the KL pass in its forward."""
    names = launched_kernels
    ins = _inputs(2)
    dout = torch.randn(B, S, H * D, device="cuda")
    _step(F.flash_msa_warmup_func, ins, kl_value, torch.zeros((), device="cuda") if metric else None, dout)
    launched = set(names)
    assert any(n.startswith(want[0]) and want[1] in n for n in launched), sorted(launched)
    assert not any(n.startswith(not_want[0]) and not_want[1] in n for n in launched), sorted(launched)
    backward_kl = any(n.startswith("warmup_bwd_proxy_") and "_kl1_" in n for n in launched)
    assert backward_kl == (kl_value == "deferred"), sorted(launched)


@pytest.mark.parametrize("kl_value, metric", [("deferred", True), ("deferred", False), ("none", False),
                                              ("exact", False)])
def test_sparse_deferred_runs_the_proxy_lse_alone(launched_kernels, tuned, kl_value, metric):
    """On a sparse step's backward route, deferred and none run the proxy lse alone (sparse_kl kl_value = 0), not
    the KL pass, and deferred with a kl_metric takes the value from the tau proxy backward's kl_value = 1 variant;
    exact mode keeps the KL pass (kl1) in its forward and the plain proxy backward."""
    tuned(kl_value={"forward_pass_rows": 0})
    names = launched_kernels
    ins = _inputs(3)
    dout = torch.randn(B, S, H * D, device="cuda")
    _step(F.flash_msa_func, ins, kl_value, torch.zeros((), device="cuda") if metric else None, dout)
    launched = sorted(set(names))
    kl_pass = [n for n in launched if n.startswith("sparse_kl_")]
    assert kl_pass and all(("_kl1_" in n) == (kl_value == "exact") for n in kl_pass), launched
    proxy = [n for n in launched if n.startswith("sparse_bwd_proxy_")]
    assert proxy and all(("_kl1_" in n) == (kl_value == "deferred" and metric) for n in proxy), launched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_kl_rows_match_the_kl_pass(dtype, deterministic):
    """The tau proxy backward's KL rows (kl_value = 1) against the KL pass's on the same selection and lse: the
    backward reads tau as the main backward wrote it (the input dtype), so a row may differ by tau's rounding,
    bounded here by 4 eps (|KL| + 1) (eps of the input dtype); the mean, which is kl_loss, within 1e-4. Rows in
    several head and query chunks (a small tau budget), odd S, G = 4."""
    from flash_msa_rt import tuning
    from flash_msa_rt.ops import sparse_bwd, sparse_fwd
    from flash_msa_rt.ops.select import select_blocks_cuda

    g = torch.Generator(device="cuda").manual_seed(11)
    Bq, Sq, Hq, Hkq, Hpq = 2, 3000, 16, 4, 4
    qp, kp, q, k, v = (torch.randn(*s, device="cuda", generator=g).to(dtype) for s in
                       ((Bq, Sq, Hpq, D), (Bq, Sq, 1, D), (Bq, Sq, Hq, D), (Bq, Sq, Hkq, D), (Bq, Sq, Hkq, D)))
    scale = D ** -0.5
    sel = select_blocks_cuda(qp, kp, 6, 128, scale)
    out, lse, lse_p, kl_rows = sparse_fwd.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    dout = torch.randn_like(q)
    klg = torch.full((Bq, Hpq, Sq), 1.0 / (Bq * Hpq * Sq), device="cuda")
    rows = []
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with tuning.override(sparse_bwd={"tau_budget": 1 << 20, "deterministic_budget": 1 << 20}):
            sparse_bwd.msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, dout, klg,
                                         deterministic=deterministic, kl_rows=rows)
    finally:
        torch.use_deterministic_algorithms(before)
    assert len(rows) == 1
    got = rows[0]
    eps = torch.finfo(dtype).eps
    err = (got - kl_rows).abs()
    bound = 4 * eps * (kl_rows.abs() + 1)
    assert torch.isfinite(got).all() and (err <= bound).all(), (err.max().item(), (err / bound).max().item())
    rel = abs(got.mean().item() - kl_rows.mean().item()) / kl_rows.mean().item()
    print(f"\n{dtype} deterministic={deterministic}: KL mean {kl_rows.mean().item():.6f}, from the backward "
          f"{got.mean().item():.6f} (relative {rel:.1e}); worst row {(err / bound).max().item():.2f} of its bound")
    assert rel <= 1e-4
