"""The tau path's fp32 accumulators per head chunk (sparse_bwd._ChunkGradients) on the CPU, with the backward kernels
replaced by stand-ins that add exact, distinguishable terms into the views they are given; the accumulator budget;
and the memory model of benchmarks/bench_memory.py (docs/memory.md).

The stand-ins add, per live plan entry (query i of proxy head p chose key block j), integers times the input rows
the kernel reads for it: every fp32 sum is then exact in any order, so chunked and whole accumulators must give the
same bits, and both the sums computed here from the selection alone.
"""

from __future__ import annotations

import pytest
import torch

from flash_msa_rt import tuning
from flash_msa_rt.ops import sparse_bwd, sparse_bwd_sums
from flash_msa_rt.ops.sparse_plan import live_slots

BS = 128


def _stand_in_kernels(deterministic: bool):
    """get_kernel for sparse_bwd: the main and proxy backward kernels' stand-ins (see the module docstring), the
    delta kernel (zeros) and the slot sums (sparse_bwd_sums.slot_sums, the kernel's torch statement)."""

    def rows(entry_query, items, heads):
        for bp, j, start, n in items.tolist():
            for e in range(start, start + n):
                b, p = divmod(bp, heads)
                yield e, b, p, j, int(entry_query[e])

    def main(q, k, v, entry_query, items, tau, dk_acc, dv_acc, hp, hp_per_hk, dq_acc=None, dq_part=None,
             entry_dest=None, **_):
        G = q.shape[2] // hp
        for e, b, p, j, i in rows(entry_query, items, hp):
            keys = slice(j * BS, min((j + 1) * BS, i + 1))  # the causal keys of block j
            heads = slice(p * G, (p + 1) * G)
            if deterministic:
                dq_part[int(entry_dest[e])] = (q[b, i, heads].float() * (j + 1)).flatten()
            else:
                dq_acc[b, i, heads] += q[b, i, heads].float() * (j + 1)
            dk_acc[b, keys, p // hp_per_hk] += v[b, keys, p // hp_per_hk].float()
            dv_acc[b, keys, p // hp_per_hk] += 2 * k[b, keys, p // hp_per_hk].float()
            tau[e] = i % 7  # what the proxy kernel must find at row e

    def proxy(q_proxy, k_proxy, tau, entry_query, items, dkp_acc, hp_per_hpk, dqp_acc=None, dqp_part=None,
              entry_dest=None, **_):
        for e, b, p, j, i in rows(entry_query, items, q_proxy.shape[2]):
            assert bool((tau[e] == i % 7).all()), "the proxy kernel reads another entry's tau row"
            keys = slice(j * BS, min((j + 1) * BS, i + 1))
            if deterministic:
                dqp_part[int(entry_dest[e])] = q_proxy[b, i, p].float() * (j + 1)
            else:
                dqp_acc[b, i, p] += q_proxy[b, i, p].float() * (j + 1)
            dkp_acc[b, keys, p // hp_per_hpk] += 3 * k_proxy[b, keys, p // hp_per_hpk].float()

    def delta(dout, out, delta):
        delta.zero_()

    def slot_sum(block_indices, part, out, query_offset):
        out.copy_(sparse_bwd_sums.slot_sums(part, block_indices, BS, query_offset))

    kernels = {"sparse_bwd": main, "sparse_bwd_proxy": proxy, "bwd_delta": delta, "slot_sum": slot_sum}
    return lambda op, config, device: kernels[op]


def _expected(qp, kp, q, k, v, sel):
    """The stand-ins' gradients from the selection alone, in fp32 (exact), cast like the runtime's."""
    B, S, H, D = q.shape
    Hp, Hk, Hpk = qp.shape[2], k.shape[2], kp.shape[2]
    G = H // Hp
    live = live_slots(sel, BS)
    weight = torch.where(live, sel + 1, 0).sum(-1).float()  # (B, Hp, S): sum of j + 1 over live slots
    dq = q.float() * weight.permute(0, 2, 1).repeat_interleave(G, dim=2).unsqueeze(-1)
    dqp = qp.float() * weight.permute(0, 2, 1).unsqueeze(-1)
    # count[b, p, t]: live entries of proxy head p whose block holds key t, causal (t <= i)
    count = torch.zeros(B, Hp, S)
    for b, p, i, slot in live.nonzero().tolist():
        j = int(sel[b, p, i, slot])
        count[b, p, j * BS:min((j + 1) * BS, i + 1)] += 1
    per_kv = count.view(B, Hk, Hp // Hk, S).sum(2).permute(0, 2, 1).unsqueeze(-1)
    per_pk = count.view(B, Hpk, Hp // Hpk, S).sum(2).permute(0, 2, 1).unsqueeze(-1)
    dk, dv, dkp = v.float() * per_kv, 2 * k.float() * per_kv, 3 * kp.float() * per_pk
    return tuple(g.to(q.dtype) for g in (dqp, dkp, dq, dk, dv))


def _inputs(B, S, H, Hk, Hp, Hpk, K, D, seed):
    gen = torch.Generator().manual_seed(seed)
    ints = lambda *shape: torch.randint(-3, 4, shape, generator=gen).to(torch.bfloat16)  # noqa: E731
    qp, kp, q, k, v = (ints(B, S, h, D) for h in (Hp, Hpk, H, Hk, Hk))
    nb = -(-S // BS)
    sel = torch.randint(-1, nb, (B, Hp, S, K), generator=gen, dtype=torch.int32)
    sel[..., 0] = torch.arange(S, dtype=torch.int32) // BS  # the local block
    return qp, kp, q, k, v, sel


def _backward(monkeypatch, inputs, deterministic, **budgets):
    monkeypatch.setattr(sparse_bwd, "get_kernel", _stand_in_kernels(deterministic))
    qp, kp, q, k, v, sel = inputs
    with tuning.override(sparse_bwd=budgets):
        return sparse_bwd.msa_backward_cuda(qp, kp, q, k, v, torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2],
                                            q.shape[1]), torch.zeros(qp.shape[0], qp.shape[2], qp.shape[1]), sel,
                                            BS, 0.1, torch.zeros_like(q), torch.ones(()),
                                            deterministic=deterministic, arch="sm90a")


SHAPES = [  # B, S, H, Hk, Hp, Hpk, K: odd S; proxy heads sharing KV heads, and proxy-key heads
    (2, 333, 8, 2, 4, 1, 3),
    (1, 300, 8, 4, 4, 2, 4),
]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_accumulators_equal_whole_ones(shape, deterministic, monkeypatch):
    """One head per chunk with its queries in chunks (runs of chunks on one KV and proxy-key head), two heads per
    chunk, and one chunk: the same gradients, bit for bit, and the sums the selection gives."""
    B, S, H, Hk, Hp, Hpk, K = shape
    D = 8
    inputs = _inputs(B, S, H, Hk, Hp, Hpk, K, D, seed=S + Hk)
    want = _expected(*inputs)
    key = "deterministic_budget" if deterministic else "tau_budget"
    per_entry = sparse_bwd.entry_bytes(BS, H // Hp, D, deterministic)
    head = B * -(-S // BS) * BS * K * per_entry  # one proxy head's rows, whole blocks of queries
    whole = _backward(monkeypatch, inputs, deterministic, **{key: 1 << 40})
    names = ("dq_proxy", "dk_proxy", "dq", "dk", "dv")
    for name, got, w in zip(names, whole, want):
        assert got.dtype == w.dtype and got.is_contiguous()
        assert torch.equal(got, w), f"{name}: one chunk against the selection's sums"
    for budget in (head // 3, 2 * head):  # one head, queries in chunks; two heads, every query
        c = sparse_bwd.tau_heads(B, S, Hp, Hk, Hpk, K, BS, budget, per_entry)
        assert c == (1 if budget < head else 2)
        assert (sparse_bwd.tau_chunk(B, S, c, K, BS, budget, per_entry) < S) == (budget < head)
        chunked = _backward(monkeypatch, inputs, deterministic, **{key: budget})
        for name, got, w in zip(names, chunked, whole):
            assert torch.equal(got, w), f"{name}: chunks of {c} heads at budget {budget}"


def test_accumulator_budget_cuts_the_heads(monkeypatch):
    """With tau rows that fit one chunk, the accumulator budget alone cuts the heads (one per chunk here): the same
    gradients; the deterministic path has no query-gradient accumulators and ignores it."""
    B, S, H, Hk, Hp, Hpk, K = SHAPES[0]
    D = 8
    inputs = _inputs(B, S, H, Hk, Hp, Hpk, K, D, seed=7)
    per_head = 4 * B * S * (H // Hp * D + D)
    assert sparse_bwd.accumulator_heads(B, S, Hp, Hk, Hpk, H // Hp, D, D, per_head) == 1
    assert sparse_bwd.accumulator_heads(B, S, Hp, Hk, Hpk, H // Hp, D, D, Hp * per_head) == Hp
    launches = []
    kernels = _stand_in_kernels(False)
    monkeypatch.setattr(sparse_bwd, "get_kernel", lambda op, config, device: (
        lambda **a: (launches.append(op), kernels(op, config, device)(**a))))
    qp, kp, q, k, v, sel = inputs
    args = (qp, kp, q, k, v, torch.zeros_like(q), torch.zeros(B, H, S), torch.zeros(B, Hp, S), sel, BS, 0.1,
            torch.zeros_like(q), torch.ones(()))
    with tuning.override(sparse_bwd={"tau_budget": 1 << 40, "accumulator_budget": per_head}):
        got = sparse_bwd.msa_backward_cuda(*args, arch="sm90a")
    assert launches.count("sparse_bwd") == Hp
    for name, g, w in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), got, _expected(*inputs)):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("config", ["a", "b", "c"])
def test_accumulator_budget_keeps_the_tau_chunks_at_top_k_2048(config):
    """tuning.sparse_bwd's claim: at top_k 2048 (K = 16) the default accumulator budget never cuts finer than the
    tau budget, in (a), (b) and (c) at B = 1 from 8K to 1M (the chunking behind the measured host times stays); a
    chunk's accumulators fit the budget unless one head's alone exceed it ((c) from 512K: G = 16)."""
    H, Hk, Hp, Hpk = {"a": (16, 2, 4, 1), "b": (32, 8, 8, 1), "c": (64, 4, 4, 1)}[config]
    for S in (8192 << n for n in range(8)):
        t = sparse_bwd.choice("sm90a", H // Hp, 128, 128, 1, S, H)
        c_tau = sparse_bwd.tau_heads(1, S, Hp, Hk, Hpk, 16, 128, t.tau_budget)
        c_acc = sparse_bwd.accumulator_heads(1, S, Hp, Hk, Hpk, H // Hp, 128, 128, t.accumulator_budget)
        assert c_acc >= c_tau, (S, c_tau, c_acc)
        fp32 = 4 * S * c_tau * (H // Hp * 128 + 128)  # the query-gradient accumulators one chunk holds
        assert fp32 <= t.accumulator_budget or c_tau == 1, (S, fp32)  # one head is the least a chunk holds


def test_memory_model_at_one_million_tokens():
    """benchmarks/bench_memory.py's model of (b) at 1M (docs/memory.md): the backward's peak holds the inputs, dO,
    out, the five bf16 gradients, one head's fp32 accumulators, the tau rows and the plans, under the 64 GB target;
    the forward's peak is below it."""
    from benchmarks import bench_memory

    S, GiB = 1 << 20, 1 << 30
    for kl_value in ("exact", "deferred"):
        pred = bench_memory.predict_peak(S, "b", kl_value)
        floor = bench_memory.floor_bytes(S, "b")
        assert floor == int(44.5 * GiB)  # inputs 14.25 + out 8 + dO 8 + gradients 14.25 GiB
        assert pred["peak_bytes"] == max(pred["phases"].values()) == pred["phases"]["backward"]
        # + selection 0.5, lse 0.125, lse_proxy 0.03 (twice when deferred), delta 0.125, kl grad 0.03, plans 1.0,
        # tau rows 1.0, fp32 accumulators 3.5 + 0.5 (dk_proxy, shared by every chunk)
        extra = pred["peak_bytes"] - floor
        assert 6.5 * GiB < extra < 7.0 * GiB, extra / GiB
        assert pred["peak_bytes"] < bench_memory.TARGET_GB * 1e9
        assert pred["phases"]["forward"] < pred["phases"]["backward"]


def test_memory_benchmark_predicts_and_plots_on_the_cpu(tmp_path):
    """bench_memory.py --predict-only: a JSON row per (S, kl_value) with the prediction, its phases and the floor,
    and a plot; without a GPU and without --predict-only it refuses."""
    import json

    from benchmarks import bench_memory

    out, png = tmp_path / "memory.json", tmp_path / "memory.png"
    assert bench_memory.main(["--predict-only", "--seqlens", "8192,20000", "--out", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["S"], r["kl_value"]) for r in rows] == [(8192, "exact"), (8192, "deferred"), (20000, "exact"),
                                                       (20000, "deferred")]
    for r in rows:
        assert r["floor_bytes"] == bench_memory.floor_bytes(r["S"]) < r["predicted_peak_bytes"]
        assert r["predicted_peak_bytes"] == max(r["predicted_phases"].values())
    assert png.stat().st_size > 10_000
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench_memory.main(["--seqlens", "8192"])
