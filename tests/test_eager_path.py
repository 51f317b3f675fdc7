"""The eager fast path (flash_msa_rt.ops.eager) against the torch.library custom ops: the same bodies, so every
output, gradient and kl_metric value is bitwise equal; it runs only where nothing traces (torch.compile, fake
tensors, dispatch modes and make_fx see the custom ops); a backward runs under its forward's tuning overrides."""

from __future__ import annotations

import pytest
import torch

from flash_msa_rt import block_sparse_attention, flash_msa_func, flash_msa_warmup_func, tuning
from flash_msa_rt.ops import dispatch, eager

B, S, H, Hk, Hp, Hpk, D, BS = 2, 13, 4, 2, 2, 1, 8, 4


def _leaves(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g, dtype=dtype).requires_grad_() for h in (Hp, Hpk, H, Hk, Hk)]


def _step(fn, leaves, kl_value, cu_seqlens=None, seed=5):
    """out, kl_loss, kl_metric and the five gradients of fn's forward + backward on clones of leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    metric = None if kl_value == "none" else torch.full((), -1.0)
    out, kl = fn(*leaves, 2 * BS, block_size=BS, layout="bshd", kl_value=kl_value, kl_metric=metric,
                 cu_seqlens=cu_seqlens)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grads = torch.autograd.grad((out, kl), leaves, (dout, torch.tensor(0.3, dtype=kl.dtype)))
    return kl.grad_fn.name(), [out, kl, metric, *grads]


def _custom_ops(monkeypatch):
    monkeypatch.setattr(eager, "usable", lambda *tensors: False)


@pytest.mark.parametrize("fn", [flash_msa_func, flash_msa_warmup_func], ids=["sparse", "warmup"])
@pytest.mark.parametrize("kl_value", ["exact", "deferred", "none"])
@pytest.mark.parametrize("varlen", [False, True])
def test_eager_path_equals_the_custom_ops_bitwise(fn, kl_value, varlen, monkeypatch):
    leaves = _leaves(1)
    cu = torch.tensor([0, 5, S, S + 9, 2 * S], dtype=torch.int32) if varlen else None
    path, got = _step(fn, leaves, kl_value, cu)
    assert path == "_MsaBackward"  # the eager Function ran (the custom-op path ends in the KL mean's division)
    _custom_ops(monkeypatch)
    path, want = _step(fn, leaves, kl_value, cu)
    assert path != "_MsaBackward"
    names = ["out", "kl_loss", "kl_metric", "dq_proxy", "dk_proxy", "dq", "dk", "dv"]
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), name
    if kl_value != "none":
        assert torch.equal(got[2], got[1] if kl_value == "exact" else want[2]) and got[2] > 0


def test_eager_gradients_that_do_not_arrive_stay_none():
    """Only out used: the proxy's gradients are None; only kl_loss used: q, k and v's are None (as the custom ops)."""
    leaves = _leaves(2)
    out, kl = flash_msa_func(*leaves, 2 * BS, block_size=BS, layout="bshd")
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    assert grads[0] is None and grads[1] is None and all(g is not None for g in grads[2:])
    out, kl = flash_msa_func(*leaves, 2 * BS, block_size=BS, layout="bshd")
    grads = torch.autograd.grad(kl, leaves, allow_unused=True)
    assert all(g is not None for g in grads[:2]) and all(g is None for g in grads[2:])


def test_eager_block_sparse_equals_the_custom_op(monkeypatch):
    q, k, v = _leaves(3)[2:]
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(-1, -(-S // BS), (B, Hk, S, 2), generator=g, dtype=torch.int32)
    dout = torch.randn(B, S, H, D, generator=g)

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = block_sparse_attention(*leaves, idx, BS, layout="bshd", return_lse=True)
        return out.grad_fn.name(), [out, lse, *torch.autograd.grad(out, leaves, dout)]

    path, got = run()
    assert path == "_BlockSparseBackward"
    _custom_ops(monkeypatch)
    path, want = run()
    assert path != "_BlockSparseBackward"
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_backward_runs_under_its_forwards_tuning_overrides_on_the_eager_path():
    """As the custom ops' rule: the backward re-enters the overrides its forward ran under (autograd runs a CUDA
    backward on threads of its own)."""
    seen = {}

    def recording(op):
        def run(*args, **kwargs):
            seen[op] = tuning.current()
            return dispatch.reference_impl(op)(*args, **kwargs)
        return run

    dispatch.register_backend(dispatch.Backend("test-eager-tuning", "cpu", lambda p: None,
                                               {op: recording(op) for op in ("msa_forward", "msa_backward")}))
    try:
        leaves = _leaves(6)
        with tuning.override(sparse_bwd={"producer": False}) as applied:
            out, kl = flash_msa_func(*leaves, 2 * BS, block_size=BS, layout="bshd")
        assert kl.grad_fn.name() == "_MsaBackward" and tuning.current() == tuning.NONE
        (out.square().sum() + kl).backward()
        assert seen["msa_forward"] == seen["msa_backward"] == applied != tuning.NONE
    finally:
        dispatch.unregister_backend("test-eager-tuning")


def test_eager_path_needs_plain_untraced_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    t = torch.randn(2)
    assert eager.usable(t, None, torch.nn.Parameter(torch.randn(1)))
    with torch.device("cpu"):  # a default-device context changes nothing the bodies rely on
        assert eager.usable(t)
    with FakeTensorMode() as mode:
        assert not eager.usable(t)
        fake = mode.from_tensor(t)
    assert not eager.usable(fake)

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert not eager.usable(t)
    seen = []
    make_fx(lambda x: seen.append(eager.usable(x)) or x + 1)(t)
    make_fx(lambda x: seen.append(eager.usable(x)) or x + 1, pre_dispatch=True)(t)
    assert seen == [False, False]


def test_torch_compile_traces_the_custom_ops():
    """Under torch.compile the graph holds the flash_msa custom ops (the eager Function never enters it)."""
    targets = []

    def recording_backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    leaves = _leaves(7)
    fn = torch.compile(lambda *x: flash_msa_func(*x, 2 * BS, block_size=BS, layout="bshd"),
                       backend=recording_backend, fullgraph=True)
    out, kl = fn(*leaves)
    assert any("flash_msa.msa_forward" in t for t in targets) and any("flash_msa.select_blocks" in t for t in targets)
    want_out, want_kl = flash_msa_func(*leaves, 2 * BS, block_size=BS, layout="bshd")
    assert torch.equal(out, want_out) and torch.equal(kl, want_kl)


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_a_double_backward_raises_on_both_paths(path, monkeypatch):
    """The backward has no derivative of its own: differentiating a create_graph gradient raises (the custom ops:
    no autograd formula for msa_backward), never silently drops the second order."""
    if path == "custom_op":
        _custom_ops(monkeypatch)
    leaves = _leaves(8)
    out, kl = flash_msa_func(*leaves, 2 * BS, block_size=BS, layout="bshd")
    (g,) = torch.autograd.grad(kl, leaves[0], create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula|no derivative of its own"):
        g.sum().backward()


def test_the_kl_pass_alone_plans_every_chunk_at_once(monkeypatch, tuned):
    """kl_value "deferred" runs the KL pass alone in the backward (sparse_fwd.msa_kl_cuda on the selection tensor):
    its chunks' plans come from one chunk_plans (the plan kernels on CUDA tensors), not a torch sort per chunk; with
    the kernels replaced by their emulated contract in three query chunks, lse_proxy and kl_rows are the reference
    forward's (float64)."""
    from flash_msa_rt import reference
    from flash_msa_rt.ops import sparse_fwd
    from flash_msa_rt.ops.partials import combine_kl_lse, kl_groups
    from tests.sparse_emulate import emulate_kl

    gen = torch.Generator().manual_seed(33)
    Bk, Sk, Hk_, Hpk_, Dk, block = 2, 300, 2, 1, 16, 128
    qp, kp, q, k, v = (torch.randn(Bk, Sk, h, Dk, generator=gen, dtype=torch.float64)
                       for h in (Hp, Hpk_, 2 * Hp, Hk_, Hk_))
    scale = Dk ** -0.5
    sel = reference.select_blocks(qp, kp, 2, block, scale)
    _, lse, want_lsep, want_kl = reference.msa_forward(qp, kp, q, k, v, sel, block, scale)

    chunk_plans, planned = sparse_fwd.chunk_plans, []

    def recorded(*args, **kwargs):
        planned.append(chunk_plans(*args, **kwargs))
        return planned[-1]

    def plan_of(entry_query):
        return next(p for plans in planned for (p,) in plans.values() if p.entry_query is entry_query)

    def emulated_kernel(op, config, device):
        def launch(lse, kl_part, q, k, q_proxy, k_proxy, scale, entry_query, **_):
            kl_part.copy_(emulate_kl(plan_of(entry_query), q, k, q_proxy, k_proxy, lse, scale))

        def merge(block_indices, kl_part, lse_proxy, kl_rows, query_offset):  # the merge kernel's torch statement
            plan = next(p for plans in planned for (p,) in plans.values() if p.query_offset == query_offset)
            lse_proxy[:], kl_rows[:] = combine_kl_lse(plan, block_indices, kl_part)
        return launch if op == "sparse_kl" else merge

    monkeypatch.setattr(sparse_fwd, "chunk_plans", recorded)
    monkeypatch.setattr(sparse_fwd, "sparse_plan", lambda *a, **kw: pytest.fail("a torch sort per chunk"))
    monkeypatch.setattr(sparse_fwd, "get_kernel", emulated_kernel)
    tuned(sparse_fwd={"kl_partials_budget": Bk * Hp * 2 * 4 * 3 * kl_groups(block) * block})  # 128-query chunks
    lsep, kl = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, block, scale)
    assert len(planned) == 1 and sorted(planned[0]) == [(0, 0), (0, 128), (0, 256)]
    torch.testing.assert_close(lsep, want_lsep.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl, want_kl.float(), rtol=1e-5, atol=1e-6)


def test_the_kl_pass_alone_sorts_one_head_group_at_a_time_past_max_cells(monkeypatch, tuned):
    """Where the plan kernels cannot sort the whole selection at once (all chunks' count matrices past
    tuning.plan's max_cells) but can one proxy head's, the KL pass alone runs in chunks of one head (head-sliced
    views) on per-head sorts instead of the batched torch sort (at (b) S = 1M, B = 1 the deferred backward's proxy
    lse pass); with the plan kernels and the pass emulated, lse_proxy and kl_rows are the reference forward's."""
    from flash_msa_rt import reference
    from flash_msa_rt.ops import sparse_fwd, sparse_plan as sp
    from flash_msa_rt.ops.partials import combine_kl_lse, kl_groups
    from tests.sparse_emulate import emulate_kl, plan_lists_kernels

    gen = torch.Generator().manual_seed(34)
    Bk, Sk, Hp_, Hk_, Hpk_, Dk, block = 2, 300, 4, 2, 1, 16, 128
    qp, kp, q, k, v = (torch.randn(Bk, Sk, h, Dk, generator=gen, dtype=torch.float64)
                       for h in (Hp_, Hpk_, 2 * Hp_, Hk_, Hk_))
    scale = Dk ** -0.5
    sel = reference.select_blocks(qp, kp, 2, block, scale)
    _, lse, want_lsep, want_kl = reference.msa_forward(qp, kp, q, k, v, sel, block, scale)

    tuned(plan={"tile_rows": 16})
    chunk = 128
    one_head = sp.chunk_keys(Bk, 1, Sk, 2, 1, chunk, block).cells
    tuned(plan={"tile_rows": 16, "max_cells": one_head},
          sparse_fwd={"kl_partials_budget": Bk * Hp_ * 2 * 4 * 3 * kl_groups(block) * chunk})  # 128-query chunks

    def on_device(s, bs, group, heads, queries):  # lists_on_device's fit test, as on CUDA tensors
        ck = sp.chunk_keys(*s.shape, heads, queries, bs)
        return ck if ck.cells <= sp.tuning_plan.choose("").max_cells else None

    sorted_shapes, sort = [], sp.sorted_lists_on_device
    monkeypatch.setattr(sp, "lists_on_device", on_device)
    monkeypatch.setattr(sparse_fwd, "lists_on_device", on_device)
    monkeypatch.setattr(sp, "_lists_kernels", lambda *a: plan_lists_kernels(block, tile_rows=16))
    monkeypatch.setattr(sp, "sorted_lists_on_device", lambda *a: sorted_shapes.append(a[0].shape) or sort(*a))
    plan_by_entries, launched = {}, []
    chunk_plans = sparse_fwd.chunk_plans

    def recorded(*args, **kwargs):
        plans = chunk_plans(*args, **kwargs)
        plan_by_entries.update({id(p.entry_query): p for (p,) in plans.values()})
        return plans

    def emulated_kernel(op, config, device):
        def launch(lse, kl_part, q, k, q_proxy, k_proxy, scale, entry_query, **_):
            launched.append((plan_by_entries[id(entry_query)], q_proxy.shape[2], q.shape[2], k.shape[2]))
            kl_part.copy_(emulate_kl(launched[-1][0], q, k, q_proxy, k_proxy, lse, scale))

        def merge(block_indices, kl_part, lse_proxy, kl_rows, query_offset):  # the merge kernel's torch statement
            lse_proxy[:], kl_rows[:] = combine_kl_lse(launched[-1][0], block_indices, kl_part)
        return launch if op == "sparse_kl" else merge

    monkeypatch.setattr(sparse_fwd, "chunk_plans", recorded)
    monkeypatch.setattr(sparse_fwd, "get_kernel", emulated_kernel)
    lsep, kl = sparse_fwd.msa_kl_cuda(qp, kp, q, k, lse, sel, block, scale)
    assert sorted_shapes == [(Bk, 1, Sk, 2)] * Hp_  # one sort per head
    assert [(p.Hp, p.query_offset, hp, h, hk) for p, hp, h, hk in launched] == \
        [(1, s0, 1, 2, 1) for _ in range(Hp_) for s0 in (0, 128, 256)]
    torch.testing.assert_close(lsep, want_lsep.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl, want_kl.float(), rtol=1e-5, atol=1e-6)
