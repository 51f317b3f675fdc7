"""Host work of the chunked forward and backward (CPU, fake tensors, kernels replaced by recorders).

Small problems are host-bound (kernels_src/sparse_fwd/NOTES.md, "Host overhead"), and each torch op the launchers
issue costs the host ~10-20 us. The plans of every chunk come from one sort (sparse_plan.chunk_plans), so the ops
a call issues must not grow with its chunk count beyond the per-chunk selection copy: this pins that down.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from flash_msa_rt import tuning

# Ops that only make views or read metadata (no device work, no kernel launch).
VIEWS = {"aten.slice", "aten.select", "aten.alias", "aten.view", "aten.as_strided", "aten.expand", "aten.unsqueeze",
         "aten._unsafe_view", "aten.t", "aten.permute", "aten.transpose", "prim.device", "aten.detach",
         "aten.lift_fresh", "aten.split", "aten.split_with_sizes", "aten.unbind"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _calls(B, S, H, Hk, Hp, budgets, monkeypatch, plan_kernels=False):
    """(forward ops, backward ops, launches) of one msa_forward_cuda + msa_backward_cuda on sm90a's kernels (the
    tau path), each ops a Counter by torch op, with the forward's partials and the backward's tau rows held to
    budgets (bytes); plan_kernels: the plans on the plan kernels, as on CUDA tensors (recorded too). The forward
    keeps its sorted lists for the backward, as the kernel backend calls it."""
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops import sparse_plan as sp

    launches = collections.Counter()

    def recorder(op, config, device):
        def launch(**kwargs):
            launches[op] += 1
        return launch

    monkeypatch.setattr(sf, "get_kernel", recorder)
    monkeypatch.setattr(sb, "get_kernel", recorder)
    if plan_kernels:
        monkeypatch.setattr(sp, "lists_on_device", lambda idx, bs, group, heads, queries: sp.chunk_keys(
            *idx.shape, heads, queries, bs))
        monkeypatch.setattr(sp, "_lists_kernels", lambda bs, K, dev: tuple(
            recorder(n, None, None) for n in ("count", "scatter", "items")))
    over = {"sparse_fwd": {"partials_budget": budgets[0]}, "sparse_bwd": {"tau_budget": budgets[1]}} if budgets else {}
    D, K, bf16 = 128, 16, torch.bfloat16
    with FakeTensorMode():
        qp, kp = torch.empty(B, S, Hp, D, dtype=bf16), torch.empty(B, S, 1, D, dtype=bf16)
        q = torch.empty(B, S, H, D, dtype=bf16)
        k, v = torch.empty(B, S, Hk, D, dtype=bf16), torch.empty(B, S, Hk, D, dtype=bf16)
        sel = torch.zeros(B, Hp, S, K, dtype=torch.int32)
        with tuning.override(**over), _Count() as fwd:  # sm90a's variants and choices, on fake CPU tensors
            out, lse, lse_p, _ = sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, 0.1, arch="sm90a", keep_lists=True)
        with tuning.override(**over), _Count() as bwd:
            sb.msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, 0.1, torch.empty_like(q),
                                 torch.full((), 1.0), arch="sm90a")
    return fwd.ops, bwd.ops, launches


def _count(B, S, H, Hk, Hp, budgets, monkeypatch):
    """(forward ops, backward ops, launches per kernel) of _calls, the ops summed."""
    fwd, bwd, launches = _calls(B, S, H, Hk, Hp, budgets, monkeypatch)
    return sum(fwd.values()), sum(bwd.values()), launches


@pytest.mark.parametrize("shape", [(1, 8192, 16, 2, 4), (2, 4096, 32, 8, 8)])
def test_host_ops_do_not_grow_with_the_chunks(shape, monkeypatch):
    """Many chunks cost the host what one chunk costs, plus the batched plan's fixed work and one selection copy
    per chunk; every chunk still launches its kernels."""
    B, S, H, Hk, Hp = shape
    fwd1, bwd1, launches1 = _count(B, S, H, Hk, Hp, None, monkeypatch)
    assert launches1["sparse_fwd"] == launches1["sparse_bwd"] == 1
    monkeypatch.undo()
    E, G = B * S * 16, H // Hp  # one proxy head's entries
    per_entry = (G * 128 * 2 + 4 * (G + 12), 2 * 128)  # partials, tau row
    fwd_n, bwd_n, launches_n = _count(B, S, H, Hk, Hp, [E * n // 4 for n in per_entry], monkeypatch)
    n_fwd, n_bwd = launches_n["sparse_fwd"], launches_n["sparse_bwd"]
    assert n_fwd >= 4 * Hp and n_bwd >= 4 * Hp, (n_fwd, n_bwd)  # four chunks of queries per head
    assert launches_n["sparse_kl"] == launches_n["sparse_combine"] == n_fwd
    assert fwd_n <= fwd1 + 80 + 2 * n_fwd, (fwd1, fwd_n, n_fwd)
    assert bwd_n <= bwd1 + 80 + 2 * n_bwd, (bwd1, bwd_n, n_bwd)


def test_host_ops_of_one_chunk(monkeypatch):
    """At (a) B = 1, S = 8K (one chunk, host-bound) one forward issues 54 compute
    ops and one backward 60 (64 and 70 before the batched cut took its cuts as a broadcast dimension): a ceiling,
    so that the per-call host work does not creep back."""
    fwd, bwd, launches = _count(1, 8192, 16, 2, 4, None, monkeypatch)
    assert launches["sparse_fwd"] == launches["sparse_bwd"] == 1
    assert fwd <= 54 and bwd <= 60, (fwd, bwd)


@pytest.mark.parametrize("order, most", [("list", 7), ("size", 9)])
def test_plans_on_the_plan_kernels_issue_few_ops(order, most):
    """On the plan kernels (CUDA tensors) chunk_plans is three launches and a handful of torch ops whatever the
    chunking (the torch sort and cut took ~35): the host work small problems are bound by."""
    from flash_msa_rt.ops import sparse_plan as sp

    launches = []
    kernels = tuple((lambda name: lambda **kw: launches.append(name))(n) for n in ("count", "scatter", "items"))
    with FakeTensorMode():
        idx = torch.zeros(2, 8, 4096, 16, dtype=torch.int32)
        for heads, queries in ((8, 4096), (2, 4096), (2, 1024)):
            launches.clear()
            with _Count() as ops:
                plans = sp._kernel_plans(idx, 128, 4, heads, queries, ((32, 64), (64, 32)), order, kernels=kernels)
            assert len(plans) == (8 // heads) * (4096 // queries)
            assert launches == ["count", "scatter", "items"] and sum(ops.ops.values()) <= most, ops.ops



def test_host_ops_of_one_chunk_on_the_plan_kernels(monkeypatch):
    """The same call with its plans on the plan kernels (as on CUDA tensors): 14 forward and 13 backward compute
    ops (16 and 18 before the backward took the forward's sorted lists and this host-bound size dropped the
    forward's longest-first sort), the backward's five fp32 accumulators from one fill (sparse_bwd.accumulators)
    and no sort of its own."""
    fwd, bwd, launches = _calls(1, 8192, 16, 2, 4, None, monkeypatch, plan_kernels=True)
    assert launches["count"] == launches["scatter"] == 1 and launches["items"] == 2
    assert launches["sparse_fwd"] == launches["sparse_bwd"] == launches["sparse_bwd_proxy"] == 1
    assert sum(fwd.values()) <= 14 and sum(bwd.values()) <= 13, (fwd, bwd)
    assert bwd["aten.zeros"] <= 1 and bwd["aten._to_copy"] == 5, bwd
