"""The flash_msa::* torch.library ops: opcheck (schema, fake impls, autograd registration, AOT dispatch), gradcheck
of their autograd formulas in float64, and the backend dispatch they all go through."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.library import opcheck

import flash_msa_rt.reference as reference
from flash_msa_rt.ops import dispatch
from flash_msa_rt.ops import library as ops  # noqa: F401  (registers the ops)

B, S, H, Hk, Hp, Hpk, D, Dp, BS, K = 2, 7, 4, 2, 2, 1, 8, 4, 4, 2
SCALE = D ** -0.5
CU = [0, 3, 3, 10, 14]  # varlen: 14 packed tokens, an empty sequence


def bshd(b, s, heads, d, dtype=torch.float32, grad=False, gen=None, transposed=False):
    if transposed:  # a (b, heads, s, d) tensor seen as (b, s, heads, d): strided, as the bhsd API passes it
        t = torch.randn(b, heads, s, d, dtype=dtype, generator=gen).transpose(1, 2)
    else:
        t = torch.randn(b, s, heads, d, dtype=dtype, generator=gen)
    return t.requires_grad_(grad)


def five(b=B, s=S, dtype=torch.float32, grad=True, transposed=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [bshd(b, s, h, d, dtype, grad, g, transposed) for h, d in ((Hp, Dp), (Hpk, Dp), (H, D), (Hk, D), (Hk, D))]


def cu():
    return torch.tensor(CU, dtype=torch.int32)


def selection(qp, kp, cu_seqlens=None):
    return torch.ops.flash_msa.select_blocks(qp.detach(), kp.detach(), K, BS, SCALE, cu_seqlens)


# --- opcheck -----------------------------------------------------------------------------------------------------

def _msa_cases():
    dense = five()
    strided = five(transposed=True, seed=1)
    packed = five(b=1, s=CU[-1], seed=2)
    return [pytest.param(dense, None, id="dense"), pytest.param(strided, None, id="strided"),
            pytest.param(packed, cu(), id="varlen")]


@pytest.mark.parametrize("args, cu_seqlens", _msa_cases())
def test_opcheck_select_and_msa(args, cu_seqlens):
    qp, kp, q, k, v = args
    opcheck(torch.ops.flash_msa.select_blocks.default, (qp.detach(), kp.detach(), K, BS, SCALE, cu_seqlens))
    idx = selection(qp, kp, cu_seqlens)
    opcheck(torch.ops.flash_msa.msa_forward.default, (qp, kp, q, k, v, idx, BS, SCALE, cu_seqlens))
    out, lse, lse_p, kl_rows = torch.ops.flash_msa.msa_forward(qp, kp, q, k, v, idx, BS, SCALE, cu_seqlens)
    grad_out = torch.randn_like(out)
    saved = [t.detach() for t in (qp, kp, q, k, v, out, lse, lse_p)]
    for g, klg in ((grad_out, torch.tensor(0.3 / kl_rows.numel())), (None, torch.rand_like(kl_rows)), (grad_out, None)):
        opcheck(torch.ops.flash_msa.msa_backward.default, (*saved, idx, BS, SCALE, g, klg, cu_seqlens))
    # deferred KL mode's ops: the backward writing the value into kl_metric, the KL pass asked for lse_proxy alone
    metric = torch.zeros((), dtype=torch.float32, device=q.device)
    args_kl = (*saved, idx, BS, SCALE, grad_out, torch.tensor(0.3 / kl_rows.numel()), metric, cu_seqlens)
    opcheck(torch.ops.flash_msa.msa_backward_kl.default, args_kl)
    torch.ops.flash_msa.msa_backward_kl(*args_kl)  # opcheck runs on copies: the value lands here
    torch.testing.assert_close(metric, kl_rows.detach().mean().to(metric.dtype))
    opcheck(torch.ops.flash_msa.msa_kl.default, (*saved[:5], saved[6], idx, BS, SCALE, cu_seqlens),
            {"with_kl": False})


@pytest.mark.parametrize("args, cu_seqlens", _msa_cases())
def test_opcheck_warmup(args, cu_seqlens):
    qp, kp, q, k, v = args
    opcheck(torch.ops.flash_msa.warmup_forward.default, (qp, kp, q, k, v, SCALE, cu_seqlens))
    out, lse, lse_p, kl_rows = torch.ops.flash_msa.warmup_forward(qp, kp, q, k, v, SCALE, cu_seqlens)
    saved = [t.detach() for t in (qp, kp, q, k, v, out, lse, lse_p)]
    opcheck(torch.ops.flash_msa.warmup_backward.default,
            (*saved, SCALE, torch.randn_like(out), torch.tensor(0.1), cu_seqlens))
    metric = torch.zeros((), dtype=torch.float32, device=q.device)
    args_kl = (*saved, SCALE, torch.randn_like(out), torch.tensor(0.1), metric, cu_seqlens)
    opcheck(torch.ops.flash_msa.warmup_backward_kl.default, args_kl)
    torch.ops.flash_msa.warmup_backward_kl(*args_kl)  # opcheck runs on copies: the value lands here
    torch.testing.assert_close(metric, kl_rows.detach().mean().to(metric.dtype))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_opcheck_block_sparse(varlen):
    b, s = (1, CU[-1]) if varlen else (B, S)
    g = torch.Generator().manual_seed(3)
    q, k, v = (bshd(b, s, h, D, grad=True, gen=g) for h in (H, Hk, Hk))
    cu_seqlens = cu() if varlen else None
    if varlen:  # indices relative to each sequence: a selection is a valid example
        idx = selection(bshd(1, s, Hk, Dp, gen=g), bshd(1, s, Hk, Dp, gen=g), cu_seqlens)
    else:
        idx = torch.randint(-1, -(-s // BS), (b, Hk, s, 3), generator=g, dtype=torch.int32)
    opcheck(torch.ops.flash_msa.block_sparse_forward.default, (q, k, v, idx, BS, SCALE, cu_seqlens))
    out, lse = torch.ops.flash_msa.block_sparse_forward(q, k, v, idx, BS, SCALE, cu_seqlens)
    opcheck(torch.ops.flash_msa.block_sparse_backward.default,
            (q.detach(), k.detach(), v.detach(), out.detach(), lse, idx, BS, SCALE, torch.randn_like(out),
             cu_seqlens))


# --- autograd formulas -------------------------------------------------------------------------------------------

def test_gradcheck_msa_forward_float64():
    """out is differentiable in q, k, v; kl_rows in q_proxy, k_proxy (tau detached: its q, k, v path is cut)."""
    qp, kp, q, k, v = five(b=1, s=6, dtype=torch.float64, seed=4)
    idx = selection(qp, kp)
    torch.autograd.gradcheck(lambda q, k, v: torch.ops.flash_msa.msa_forward(qp, kp, q, k, v, idx, BS, SCALE)[0],
                             (q, k, v), fast_mode=True)
    torch.autograd.gradcheck(lambda qp, kp: torch.ops.flash_msa.msa_forward(qp, kp, q, k, v, idx, BS, SCALE)[3],
                             (qp, kp), fast_mode=True)


def test_gradcheck_warmup_and_block_sparse_float64():
    qp, kp, q, k, v = five(b=1, s=6, dtype=torch.float64, seed=5)
    torch.autograd.gradcheck(lambda q, k, v: torch.ops.flash_msa.warmup_forward(qp, kp, q, k, v, SCALE)[0],
                             (q, k, v), fast_mode=True)
    torch.autograd.gradcheck(lambda qp, kp: torch.ops.flash_msa.warmup_forward(qp, kp, q, k, v, SCALE)[3],
                             (qp, kp), fast_mode=True)
    idx = torch.tensor([0, 1, -1], dtype=torch.int32).expand(1, Hk, 6, 3).contiguous()
    torch.autograd.gradcheck(lambda q, k, v: torch.ops.flash_msa.block_sparse_forward(q, k, v, idx, BS, SCALE)[0],
                             (q, k, v), fast_mode=True)


def test_statistics_are_not_differentiable_and_kl_skips_main_inputs():
    qp, kp, q, k, v = five(seed=6)
    idx = selection(qp, kp)
    out, lse, lse_p, kl_rows = torch.ops.flash_msa.msa_forward(qp, kp, q, k, v, idx, BS, SCALE)
    assert out.requires_grad and kl_rows.requires_grad
    assert not lse.requires_grad and not lse_p.requires_grad
    assert lse.dtype == lse_p.dtype == kl_rows.dtype == torch.float32
    grads = torch.autograd.grad(kl_rows.sum(), (qp, kp, q, k, v), allow_unused=True, materialize_grads=True)
    assert grads[0].abs().max() > 0 and grads[1].abs().max() > 0
    assert all(not g.any() for g in grads[2:])
    _, lse = torch.ops.flash_msa.block_sparse_forward(q, k, v, idx, BS, SCALE)
    assert not lse.requires_grad


def test_float64_inputs_keep_float64_statistics():
    qp, kp, q, k, v = five(dtype=torch.float64, grad=False, seed=7)
    _, lse, lse_p, kl_rows = torch.ops.flash_msa.msa_forward(qp, kp, q, k, v, selection(qp, kp), BS, SCALE)
    assert lse.dtype == lse_p.dtype == kl_rows.dtype == torch.float64


def test_ops_equal_the_reference():
    """The op is a thin shell: same numbers as the reference function it dispatches to on CPU."""
    qp, kp, q, k, v = five(grad=False, transposed=True, seed=8)
    idx = selection(qp, kp)
    assert torch.equal(idx, reference.select_blocks(qp, kp, K, BS, SCALE))
    got = torch.ops.flash_msa.msa_forward(qp, kp, q, k, v, idx, BS, SCALE)
    want = reference.msa_forward(qp, kp, q, k, v, idx, BS, SCALE)
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.is_contiguous()


# --- dispatch ----------------------------------------------------------------------------------------------------

@pytest.fixture
def clean_dispatch():
    dispatch.reset_warnings()  # also forgets dispatch's answers
    yield
    for b in dispatch.backends():
        if b.name.startswith("test-"):
            dispatch.unregister_backend(b.name)
    dispatch.reset_warnings()


def test_a_registered_backend_runs_what_it_supports(clean_dispatch):
    calls = []

    def fwd(*args):
        calls.append(args[0].shape)
        return dispatch.reference_impl("block_sparse_forward")(*args)

    dispatch.register_backend(dispatch.Backend(
        "test-d8", "cpu", lambda p: None if p.config["head_dim"] == D else f"head_dim {p.config['head_dim']}",
        {"block_sparse_forward": fwd}))
    g = torch.Generator().manual_seed(9)
    idx = torch.zeros(B, Hk, S, 1, dtype=torch.int32)
    q, k, v = (bshd(B, S, h, D, gen=g) for h in (H, Hk, Hk))
    torch.ops.flash_msa.block_sparse_forward(q, k, v, idx, BS, SCALE)
    assert calls == [q.shape]
    q16, k16, v16 = (bshd(B, S, h, 16, gen=g) for h in (H, Hk, Hk))
    torch.ops.flash_msa.block_sparse_forward(q16, k16, v16, idx, BS, SCALE)  # declined: the reference runs it
    assert calls == [q.shape]


def test_cuda_without_kernels_falls_back_once_with_the_build_command(clean_dispatch):
    dispatch.register_backend(dispatch.Backend("test-sm90", "cuda", lambda p: "no bf16 d=8 variant built",
                                               {"msa_forward": lambda *a: None}))
    cuda = torch.device("cuda", 0)  # resolving touches no device
    with pytest.warns(RuntimeWarning) as record:
        impl = dispatch.implementation("msa_forward", cuda, torch.bfloat16, head_dim=8, block_size=4)
    assert impl is dispatch.reference_impl("msa_forward")
    msg = str(record[0].message)
    assert "python -m build_tools build --arch sm90a" in msg and "no bf16 d=8 variant built" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.implementation("msa_backward", cuda, torch.bfloat16, head_dim=8, block_size=4)
    with pytest.warns(UserWarning, match="pure-PyTorch reference.*shown once"):  # CPU: one notice ...
        dispatch.implementation("msa_forward", torch.device("cpu"), torch.bfloat16, head_dim=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.implementation("msa_backward", torch.device("cpu"), torch.bfloat16, head_dim=8)  # ... per process


def test_register_backend_rejects_unknown_ops_and_keeps_the_reference():
    with pytest.raises(ValueError, match="unknown ops.*'msa_fwd'"):
        dispatch.register_backend(dispatch.Backend("test-bad", "cuda", lambda p: None, {"msa_fwd": print}))
    with pytest.raises(ValueError, match="reference"):
        dispatch.unregister_backend("reference")


def test_a_backward_runs_under_its_forwards_tuning_overrides(clean_dispatch):
    """tuning.override is scoped to its block and its context, and autograd runs backward on threads of its own:
    the custom op's backward re-enters the overrides its forward ran under, whenever and wherever it runs."""
    import threading

    from flash_msa_rt import tuning

    seen = {}

    def recording(op):
        def run(*args):
            seen[op] = (tuning.current(), threading.get_ident())
            return dispatch.reference_impl(op)(*args)
        return run

    dispatch.register_backend(dispatch.Backend("test-tuning", "cpu", lambda p: None,
                                               {op: recording(op) for op in ("msa_forward", "msa_backward")}))
    qp, kp, q, k, v = five(seed=11)
    idx = selection(qp.detach(), kp.detach())
    with tuning.override(sparse_bwd={"producer": False}) as applied:
        out, _, _, kl = torch.ops.flash_msa.msa_forward(qp, kp, q, k, v, idx, BS, SCALE)
    assert tuning.current() == tuning.NONE
    (out.square().sum() + kl.sum()).backward()
    assert seen["msa_forward"][0] == seen["msa_backward"][0] == applied
    assert applied.fields("sparse_bwd") == {"producer": False}

    def other_thread():  # overrides do not leak into other threads
        seen["thread"] = tuning.current()

    with tuning.override(sparse_fwd={"stages": 2}):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert seen["thread"] == tuning.NONE
