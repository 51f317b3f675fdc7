"""The self-test's machinery on CPU: the dtype-relative comparison with injected errors, the selection verdict, the
record of which backend ran (a check fails when the reference ran instead of a kernel), and a whole MSA check run
against a stand-in backend on CPU tensors, exact and with one gradient perturbed. The kernels themselves are checked
on the GPU (`python -m flash_msa_rt selftest`)."""

import pytest
import torch

from flash_msa_rt import selftest as st
from flash_msa_rt import tolerances as tol


# --- tolerances -------------------------------------------------------------------------------------------------

def _exact(seed=0, shape=(64, 32)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_bound_is_a_multiple_of_what_the_dtype_costs():
    exact = _exact()
    rounding = (exact.to(torch.bfloat16).double() - exact).abs().max().item()
    mag = exact.abs().max().item()
    assert tol.bound(exact, torch.bfloat16) == pytest.approx(tol.FACTOR * rounding + tol.ATOL_REL * mag)
    assert tol.bound(exact, torch.float16) < tol.bound(exact, torch.bfloat16) / 4  # 3 more mantissa bits
    base32 = exact.float() + 0.05  # a float32 baseline that costs more than rounding to bf16 does
    assert rounding < 0.05
    assert tol.bound(exact, torch.bfloat16, base32) == pytest.approx(tol.FACTOR * 0.05 + tol.ATOL_REL * mag,
                                                                     rel=1e-4)
    assert tol.bound(exact, torch.float64) == pytest.approx(1e-10 * mag)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_injected_errors_pass_below_the_bound_and_fail_above(dtype):
    exact = _exact(1)
    limit = tol.bound(exact, dtype)
    got = exact.to(dtype)
    assert tol.check("x", got, exact).ok  # the dtype's own rounding passes
    near = exact.clone()
    near[3, 4] += 0.9 * limit
    c = tol.compare("x", near, exact, limit)
    assert c.ok and c.max_error == pytest.approx(0.9 * limit) and c.ratio() == pytest.approx(0.9)
    far = exact.clone()
    far[5, 6] -= 1.1 * limit
    c = tol.compare("x", far, exact, limit)
    assert not c.ok and "max error" in c.problem and c.ratio() == pytest.approx(1.1)
    with pytest.raises(AssertionError, match="x: max error"):
        tol.assert_ok(c)


def test_nan_and_inf_positions_must_match_before_any_number():
    exact = _exact(2)
    limit = tol.bound(exact, torch.bfloat16)
    hidden = exact.clone()
    want = exact.clone()
    want[0, 0] = float("nan")  # the exact result is NaN there; a finite kernel value hides it
    c = tol.compare("x", hidden, want, limit)
    assert not c.ok and "NaN positions differ (0 unexpected, 1 missing)" in c.problem
    invented = exact.clone()
    invented[1, 1] = float("nan")
    c = tol.compare("x", invented, exact, limit)
    assert not c.ok and "(1 unexpected, 0 missing)" in c.problem
    both = exact.clone()
    both[1, 1] = float("nan")
    assert tol.compare("x", both, both.clone(), limit).ok
    neg = exact.clone()
    neg[2, 2] = float("-inf")
    pos = neg.clone()
    pos[2, 2] = float("inf")
    assert not tol.compare("x", pos, neg, limit).ok and "sign" in tol.compare("x", pos, neg, limit).problem
    assert "shape" in tol.compare("x", exact[:3], exact, limit).problem


# --- the selection verdict --------------------------------------------------------------------------------------

def _selection_case(S=700, Hp=2, K=3):
    from flash_msa_rt import reference

    g = torch.Generator().manual_seed(7)
    qp = torch.randn(1, S, Hp, 128, generator=g).to(torch.bfloat16)
    kp = torch.randn(1, S, 1, 128, generator=g).to(torch.bfloat16)
    scale = 128 ** -0.5
    sel = reference.select_blocks(qp, kp, K, st.BLOCK, scale)
    scores = reference.proxy_block_scores(qp.double(), kp.double(), st.BLOCK, scale).double()
    return sel, scores, tol.selection_epsilon(qp, kp, scale)


def test_selection_verdict_accepts_the_contract_and_catches_each_fault():
    sel, scores, eps = _selection_case()
    assert st.selection_comparison(sel, scores, 3, eps).ok
    row = 600  # block 4: slots hold two earlier blocks and the local one
    kept = [j for j in sel[0, 0, row].tolist() if 0 <= j < 4]
    worst = min(set(range(4)) - set(kept), key=lambda j: scores[0, 0, row, j].item())
    swapped = sel.clone()
    swapped[0, 0, row][swapped[0, 0, row] == kept[0]] = worst
    c = st.selection_comparison(swapped, scores, 3, eps)
    assert not c.ok and "below" in c.problem and c.max_error > eps
    no_local = sel.clone()
    no_local[0, 1, row][no_local[0, 1, row] == 4] = worst if worst not in kept else 0
    assert not st.selection_comparison(no_local, scores, 3, eps).ok
    twice = sel.clone()
    twice[0, 0, row, :2] = kept[0]
    assert "twice" in st.selection_comparison(twice, scores, 3, eps).problem
    later = sel.clone()
    later[0, 0, 10, 0] = 3  # row 10 sits in block 0
    assert not st.selection_comparison(later, scores, 3, eps).ok


# --- which backend ran ------------------------------------------------------------------------------------------

def test_a_check_fails_when_the_reference_ran_instead_of_a_kernel():
    import flash_msa_rt

    qp, kp = torch.randn(1, 2, 300, 64), torch.randn(1, 1, 300, 64)
    with st.resolved_backends() as seen:
        flash_msa_rt.select_blocks(qp, kp, 256)
    assert seen == {"select_blocks": {"reference"}}
    assert "ran on the pure-PyTorch reference" in st.on_kernels(seen, ("select_blocks",))
    assert "never dispatched" in st.on_kernels(seen, ("msa_forward",))
    assert st.on_kernels({"select_blocks": {"kernels"}}, ("select_blocks",)) is None


@pytest.fixture
def stand_in_backend():
    """A CPU backend named 'kernels' that runs the reference, optionally with dq scaled (an injected bug)."""
    from flash_msa_rt.ops import dispatch

    state = {"dq_scale": 1.0}

    def backward(*args, **kwargs):
        dqp, dkp, dq, dk, dv = dispatch.reference_impl("msa_backward")(*args, **kwargs)
        return dqp, dkp, dq * state["dq_scale"], dk, dv

    ops = {op: dispatch.reference_impl(op) for op in dispatch.OPS}
    ops["msa_backward"] = backward
    dispatch.register_backend(dispatch.Backend("kernels-stand-in", "cpu", supports=lambda p: None, ops=ops))
    yield state
    dispatch.unregister_backend("kernels-stand-in")


def test_msa_check_rows_on_a_stand_in_backend(stand_in_backend):
    p = st.Problem(1, 300, 4, 2, 2, 1, 2)
    rows = st.check_msa(p, torch.device("cpu"), seed=3)
    assert [(r.op, r.quantity) for r in rows] == [
        ("sparse_fwd", "out"), ("sparse_kl", "kl_loss"), ("sparse_bwd", "dq"), ("sparse_bwd", "dk"),
        ("sparse_bwd", "dv"), ("sparse_bwd_proxy", "dq_proxy"), ("sparse_bwd_proxy", "dk_proxy")]
    assert all(r.status == "ok" and r.backend == "kernels-stand-in" for r in rows), [st.format_row(r) for r in rows]
    stand_in_backend["dq_scale"] = 1.02  # a 2 % error in dq: far above what bf16 costs
    rows = st.check_msa(p, torch.device("cpu"), seed=3)
    bad = [r for r in rows if r.status == "FAIL"]
    assert [(r.op, r.quantity) for r in bad] == [("sparse_bwd", "dq")] and "max error" in bad[0].detail


@pytest.mark.parametrize("D, Bs", [(64, 64), (256, 128)])
def test_every_check_runs_at_other_head_dims_and_blocks(stand_in_backend, D, Bs):
    """The checks at another point of the matrix: inputs at D (the proxy at min(D, 128)), blocks of Bs in the API
    calls and in the reference they are compared with."""
    p = st.Problem(1, 300, 4, 2, 2, 1, 3, D=D, Bs=Bs)
    assert f"D{D} Bs{Bs}" in p.label()
    for check in (st.check_select, st.check_msa, st.check_warmup, st.check_block_sparse):
        rows = check(p, torch.device("cpu"), seed=5)
        assert rows and all(r.status == "ok" and r.backend == "kernels-stand-in" for r in rows), \
            [st.format_row(r) for r in rows]


def test_selftest_checks_every_configuration_the_artifacts_carry(monkeypatch):
    """The run covers each (D, Bs) whose sparse forward (at its kernel block) and selection (at Dp) are built."""
    from flash_msa_rt import loader
    from kernels_src import matrix

    assert (st.HEAD_DIMS, st.BLOCK_SIZES) == (matrix.HEAD_DIMS, matrix.BLOCK_SIZES)
    built = {("sparse_fwd", 64): (128,), ("sparse_fwd", 128): (64, 128), ("sparse_fwd", 256): (64,),
             ("select", 64): (128,), ("select", 128): (64, 128)}
    monkeypatch.setattr(loader, "built_values", lambda op, field, arch, head_dim, dtype: built.get((op, head_dim), ()))
    configs = st.carried_configs("sm90a")
    assert configs == [(64, 128), (128, 64), (128, 128), (256, 64), (256, 128)]
    quick = st.matrix_problems(st.PROBLEMS[:1], configs, quick=True)
    assert quick[0] == st.PROBLEMS[0] and [(p.D, p.Bs) for p in quick[1:]] == [(64, 128), (128, 64), (256, 64),
                                                                              (256, 128)]
    full = st.matrix_problems(st.PROBLEMS, configs, quick=False)
    assert full[:len(st.PROBLEMS)] == st.PROBLEMS and len(full) == len(st.PROBLEMS) + 2 * 4
    assert {p.dtype for p in full[len(st.PROBLEMS):]} == {torch.bfloat16, torch.float16}
    built.pop(("select", 64))
    assert st.carried_configs("sm90a") == [(128, 64), (128, 128), (256, 64), (256, 128)]


def test_run_without_gpu_raises_no_gpu(monkeypatch):
    from flash_msa_rt.errors import NoGPUError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoGPUError, match="no CUDA device"):
        st.run(quick=True)


def test_report_table_and_json_shape():
    ok = st.Row("sparse_fwd", "bf16 B1", "out", "kernels", 1e-3, 4e-3, 0.012, "ok")
    bad = st.Row("sparse_bwd", "bf16 B1", "dq", "kernels", 9e-3, 4e-3, 0.02, "FAIL", "max error 9.000e-03 > bound")
    skip = st.Row("deterministic", "bf16 B1", "-", "-", None, None, 0.0, "skip", "no deterministic kernels on sm100a")
    report = st.Report(device="NVIDIA H200", arch="sm90a", quick=True, rows=[ok, bad, skip], seconds=1.5,
                       kernels_loaded=["select_x"])
    line = st.format_row(bad)
    assert "sparse_bwd" in line and "9.00e-03 / 4.00e-03" in line and "2.25" in line and "FAIL" in line
    assert "20.0ms" in line
    assert st.summary(report).startswith("FAILED: 1 of 2 checks (1 skipped)")
    j = report.to_json()
    assert j["passed"] is False and j["arch"] == "sm90a" and j["quick"] is True and len(j["rows"]) == 3
    assert set(j["rows"][0]) == {"op", "variant", "quantity", "backend", "max_error", "bound", "seconds", "status",
                                 "detail"}
