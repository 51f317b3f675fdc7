"""torch.compile(fullgraph=True) through the public API: the ops are opaque custom ops, the validation traces, and
forward and backward equal eager (aot_eager runs the same reference implementations)."""

from __future__ import annotations

import torch

from flash_msa_rt import block_sparse_attention, flash_msa_func, flash_msa_warmup_func, select_blocks

B, S, H, Hk, Hp, Hpk, D, Dp, BS = 2, 11, 4, 2, 2, 1, 8, 4, 4


class ThreeAttentions(torch.nn.Module):
    def forward(self, q_proxy, k_proxy, q, k, v, block_indices, kl_metric):
        sparse, kl = flash_msa_func(q_proxy, k_proxy, q, k, v, 2 * BS, block_size=BS, kl_metric=kl_metric)
        dense, kl_warm = flash_msa_warmup_func(q_proxy, k_proxy, q, k, v, 2 * BS, block_size=BS)
        bsa, lse = block_sparse_attention(q, k, v, block_indices, BS, scale=0.3, return_lse=True)
        return sparse, kl, dense, kl_warm, bsa, lse


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    heads = ((Hp, Dp), (Hpk, Dp), (H, D), (Hk, D), (Hk, D))
    return [torch.randn(B, h, S, d, generator=g).requires_grad_(True) for h, d in heads]


def _run(fn, tensors, idx, dO):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    metric = torch.zeros(())
    sparse, kl, dense, kl_warm, bsa, lse = fn(*leaves, idx, metric)
    loss = (sparse * dO[0]).sum() + (dense * dO[1]).sum() + (bsa * dO[2]).sum() + 0.3 * kl + 0.7 * kl_warm
    loss.backward()
    return [sparse, kl, dense, kl_warm, bsa, lse, metric] + [t.grad for t in leaves]


def test_compiled_module_equals_eager():
    torch._dynamo.reset()
    tensors = _inputs(0)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, -(-S // BS), (B, Hk, S, 2), generator=g, dtype=torch.int32)
    dO = [torch.randn(B, S, H * D, generator=g), torch.randn(B, S, H * D, generator=g),
          torch.randn(B, H, S, D, generator=g)]
    module = ThreeAttentions()
    want = _run(module, tensors, idx, dO)
    got = _run(torch.compile(module, backend="aot_eager", fullgraph=True), tensors, idx, dO)
    names = ["sparse", "kl", "dense", "kl_warm", "bsa", "lse", "kl_metric", "dq_proxy", "dk_proxy", "dq", "dk", "dv"]
    for name, g_, w in zip(names, got, want):
        torch.testing.assert_close(g_, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert want[6] == want[1] and want[1] > 0  # the metric holds the KL, in the compiled run too
    assert got[6] == got[1]


def test_fixed_length_api_reads_no_tensor_value():
    """Under FakeTensorMode every .item() / .tolist() / bool(tensor) raises: the fixed-length path of each public
    function runs there (its ops take their fake impls), so it never synchronises the host with a device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qp, kp, q, k, v = _inputs(2)
        idx = torch.zeros(B, Hk, S, 2, dtype=torch.int32)
        metric = torch.zeros(())
        out, kl = flash_msa_func(qp, kp, q, k, v, 2 * BS, block_size=BS, kl_metric=metric)
        (out.sum() + kl).backward()
        bshd = [t.transpose(1, 2) for t in (qp, kp, q, k, v)]
        out_w, kl_w = flash_msa_warmup_func(*bshd, 2 * BS, block_size=BS, layout="bshd")
        (out_w.sum() + kl_w).backward()
        bsa = block_sparse_attention(q, k, v, idx, BS)
        bsa.sum().backward()
        sel = select_blocks(qp, kp, 2 * BS, block_size=BS)
    assert out.shape == (B, S, H * D) and kl.shape == () and kl.dtype == torch.float32
    assert out_w.shape == (B, S, H * D) and bsa.shape == q.shape and sel.shape == (B, Hp, S, 2)
    assert qp.grad.shape == qp.shape and v.grad.shape == v.shape


# --- every entry point in every mode, fullgraph, inductor and aot_eager, against eager -----------------------------

import pytest  # noqa: E402
import torch._dynamo.testing  # noqa: E402

from flash_msa_rt import flash_msa_varlen_func, flash_msa_warmup_varlen_func, tuning  # noqa: E402

KL_VALUES = ("exact", "deferred", "none")
BACKENDS = ("aot_eager", "inductor")
# Row-aligned offsets over the B * S = 22 flattened tokens (flash_msa_func's cu_seqlens), and packs of the same
# tokens for the varlen functions; keys longer than queries: each sequence's queries are its last tokens.
CU_ROWS = (0, 5, 11, 16, 22)
CU_PACK = (0, 7, 11, 22)
CU_KEYS, Q_TOKENS, CU_QUERIES = (0, 11, 22), list(range(4, 11)) + list(range(13, 22)), (0, 7, 16)


def _flat(t):
    """(B, heads, S, D) -> (B * S, heads, D): the packed layout of the varlen functions."""
    return t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[3])


class EveryEntryPoint(torch.nn.Module):
    """Every public function in one kl_value mode: fixed length (both select_precision), warmup, row-aligned
    cu_seqlens, varlen with and without cu_seqlens_k, block-sparse with and without cu_seqlens, select_blocks."""

    def __init__(self, kl_value):
        super().__init__()
        self.kl_value = kl_value

    def forward(self, q_proxy, k_proxy, q, k, v, block_indices, cu_rows, cu_pack, cu_keys, cu_queries, metrics):
        kw = {"block_size": BS, "kl_value": self.kl_value}
        m = metrics if self.kl_value != "none" else (None,) * len(metrics)
        five = (q_proxy, k_proxy, q, k, v)
        flat = [_flat(t) for t in five]
        queries = torch.tensor(Q_TOKENS)
        separate = (flat[0][queries], flat[1], flat[2][queries], flat[3], flat[4])
        results = [
            *flash_msa_func(*five, 2 * BS, kl_metric=m[0], **kw),
            *flash_msa_func(*five, 2 * BS, select_precision="fp8", **kw),
            *flash_msa_warmup_func(*five, 2 * BS, kl_metric=m[1], **kw),
            *flash_msa_func(*five, 2 * BS, cu_seqlens=cu_rows, **kw),
            *flash_msa_varlen_func(*flat, cu_pack, 11, 2 * BS, kl_metric=m[2], **kw),
            *flash_msa_warmup_varlen_func(*flat, cu_pack, 11, 2 * BS, **kw),
            *flash_msa_varlen_func(*separate, cu_queries, 9, 2 * BS, cu_seqlens_k=cu_keys, max_seqlen_k=11, **kw),
            *block_sparse_attention(q, k, v, block_indices, BS, scale=0.3, return_lse=True),
            block_sparse_attention(q[:1], k[:1], v[:1], block_indices[:1].clamp(max=1), BS,
                                   cu_seqlens=cu_rows[:3]),  # blocks of the 5-token sequence
            select_blocks(q_proxy, k_proxy, 2 * BS, block_size=BS),
            select_blocks(q_proxy, k_proxy, 2 * BS, block_size=BS, select_precision="fp8"),
        ]
        return results


def _offsets(values):
    return torch.tensor(values, dtype=torch.int32)


def _step(fn, tensors, idx, cus, seed=3):
    """fn's results, the KL metrics and the five leaves' gradients of a loss over every differentiable result."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    metrics = tuple(torch.zeros(()) for _ in range(3))
    results = fn(*leaves, idx, *cus, metrics)
    g = torch.Generator().manual_seed(seed)
    loss = sum((r * torch.randn(r.shape, generator=g)).sum() for r in results
               if r.is_floating_point() and r.requires_grad)
    loss.backward()
    return [r.detach() for r in results] + list(metrics) + [t.grad for t in leaves]


def _assert_same(got, want, tol):
    assert len(got) == len(want)
    for n, (g_, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g_, w, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"result {n}: {m}")


def _indices():
    g = torch.Generator().manual_seed(1)
    return torch.randint(-1, -(-S // BS), (B, Hk, S, 2), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kl_value", KL_VALUES)
def test_every_entry_point_compiles_fullgraph(kl_value, backend):
    """fullgraph=True fails on any graph break; the results, KL metrics and gradients equal eager (inductor fuses
    the loss's reductions: a few ulps)."""
    torch._dynamo.reset()
    tensors, idx = _inputs(4), _indices()
    cus = tuple(_offsets(c) for c in (CU_ROWS, CU_PACK, CU_KEYS, CU_QUERIES))
    module = EveryEntryPoint(kl_value)
    want = _step(module, tensors, idx, cus)
    got = _step(torch.compile(module, backend=backend, fullgraph=True), tensors, idx, cus)
    _assert_same(got, want, 1e-6 if backend == "aot_eager" else 1e-4)
    if kl_value != "none":
        assert all(m > 0 for m in want[-8:-5]), "every KL metric written (deferred: by the backward)"


def test_deferred_forward_pass_route_compiles():
    """kl_value="deferred" where tuning.kl_value has the forward run the KL pass (kl_loss still 0, the backward
    writes kl_metric from the forward's rows): the override is read once at trace time, outside the graph."""
    torch._dynamo.reset()
    tensors, idx = _inputs(5), _indices()
    cus = tuple(_offsets(c) for c in (CU_ROWS, CU_PACK, CU_KEYS, CU_QUERIES))
    module = EveryEntryPoint("deferred")
    with tuning.override(kl_value={"forward_pass_devices": ("cpu",)}):
        want = _step(module, tensors, idx, cus)
        got = _step(torch.compile(module, backend="aot_eager", fullgraph=True), tensors, idx, cus)
    _assert_same(got, want, 1e-6)


def test_no_graph_break_explained():
    """torch._dynamo.explain agrees: one graph, no break, for the deferred mode (the one that broke on the tuning
    overrides' ContextVar)."""
    torch._dynamo.reset()
    tensors, idx = _inputs(6), _indices()
    cus = tuple(_offsets(c) for c in (CU_ROWS, CU_PACK, CU_KEYS, CU_QUERIES))
    explained = torch._dynamo.explain(EveryEntryPoint("deferred"))(*tensors, idx, *cus,
                                                                   tuple(torch.zeros(()) for _ in range(3)))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def _packed_call(q_proxy, k_proxy, q, k, v, cu):
    return flash_msa_varlen_func(q_proxy, k_proxy, q, k, v, cu, 11, 2 * BS, block_size=BS, kl_value="deferred")


def test_compiled_varlen_takes_new_offsets_without_host_read():
    """The compiled graph holds no offsets' values: new offsets of the same count give eager's results on the next
    call (no recompilation, no stale plan). Offsets that break the contract: the graph's device check makes the
    outputs NaN (as under CUDA graph capture); on the CPU the reference inside the op reads them first and raises,
    naming cu_seqlens (no synchronisation: they are host memory)."""
    torch._dynamo.reset()
    flat = [_flat(t) for t in _inputs(7)]
    counts = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_packed_call, backend=counts, fullgraph=True)
    for cu in ((0, 7, 11, 22), (0, 11, 11, 22), (0, 2, 13, 22)):
        cu = _offsets(cu)
        got, want = compiled(*flat, cu), _packed_call(*flat, cu)
        _assert_same(list(got), list(want), 1e-6)
    assert counts.frame_count == 1
    with pytest.raises(ValueError, match="cu_seqlens"):
        compiled(*flat, _offsets((0, 5, 23, 22)))  # decreasing, past the tokens, longer than max_seqlen
    assert counts.frame_count == 1


# --- issue 58's options (sinks, proxy_scale, local_blocks) under torch.compile -------------------------------------

PROXY_SCALE = 0.9  # != Dp ** -0.5 (the main scale is D ** -0.5)


class EveryEntryPointWithOptions(torch.nn.Module):
    """Every public function with sinks (a leaf: its gradient flows), proxy_scale != scale and local_blocks = 2
    where each applies: fixed length (bf16 and fp8 selection, row-aligned cu_seqlens), warmup, varlen with and
    without cu_seqlens_k, block-sparse with and without cu_seqlens, select_blocks."""

    def __init__(self, kl_value):
        super().__init__()
        self.kl_value = kl_value

    def forward(self, q_proxy, k_proxy, q, k, v, sinks, block_indices, cu_rows, cu_pack, cu_keys, cu_queries,
                metrics):
        kw = {"block_size": BS, "kl_value": self.kl_value, "sinks": sinks, "proxy_scale": PROXY_SCALE,
              "local_blocks": 2}
        m = metrics if self.kl_value != "none" else (None,) * len(metrics)
        five = (q_proxy, k_proxy, q, k, v)
        flat = [_flat(t) for t in five]
        queries = torch.tensor(Q_TOKENS)
        separate = (flat[0][queries], flat[1], flat[2][queries], flat[3], flat[4])
        return [
            *flash_msa_func(*five, 2 * BS, kl_metric=m[0], **kw),
            *flash_msa_func(*five, 2 * BS, select_precision="fp8", **kw),
            *flash_msa_func(*five, 2 * BS, cu_seqlens=cu_rows, **kw),
            *flash_msa_warmup_func(*five, 2 * BS, kl_metric=m[1], **kw),
            *flash_msa_varlen_func(*flat, cu_pack, 11, 2 * BS, kl_metric=m[2], **kw),
            *flash_msa_warmup_varlen_func(*flat, cu_pack, 11, 2 * BS, **kw),
            *flash_msa_varlen_func(*separate, cu_queries, 9, 2 * BS, cu_seqlens_k=cu_keys, max_seqlen_k=11, **kw),
            *block_sparse_attention(q, k, v, block_indices, BS, scale=0.3, return_lse=True, sinks=sinks),
            block_sparse_attention(q[:1], k[:1], v[:1], block_indices[:1].clamp(max=1), BS, cu_seqlens=cu_rows[:3],
                                   sinks=sinks),
            select_blocks(q_proxy, k_proxy, 2 * BS, block_size=BS, proxy_scale=PROXY_SCALE, local_blocks=2),
            select_blocks(q_proxy, k_proxy, 2 * BS, block_size=BS, select_precision="fp8", local_blocks=2),
        ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kl_value", ("exact", "deferred"))
def test_sinks_proxy_scale_local_blocks_compile_fullgraph(kl_value, backend):
    """fullgraph=True with sinks, proxy_scale and local_blocks given: results, KL metrics and every gradient (d sinks
    included) equal eager."""
    torch._dynamo.reset()
    tensors, idx = _inputs(8), _indices()
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(9))
    cus = tuple(_offsets(c) for c in (CU_ROWS, CU_PACK, CU_KEYS, CU_QUERIES))
    module = EveryEntryPointWithOptions(kl_value)

    def step(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (*tensors, sinks)]
        metrics = tuple(torch.zeros(()) for _ in range(3))
        results = fn(*leaves, idx, *cus, metrics)
        g = torch.Generator().manual_seed(3)
        loss = sum((r * torch.randn(r.shape, generator=g)).sum() for r in results
                   if r.is_floating_point() and r.requires_grad)
        loss.backward()
        return [r.detach() for r in results] + list(metrics) + [t.grad for t in leaves]

    want = step(module)
    got = step(torch.compile(module, backend=backend, fullgraph=True))
    _assert_same(got, want, 1e-6 if backend == "aot_eager" else 1e-4)
    assert want[-1] is not None and want[-1].abs().sum() > 0, "d sinks flows"
    assert all(m > 0 for m in want[-9:-6]), "every KL metric written (deferred: by the backward)"
    # the options reach the compiled graph: they change the results against the defaults
    plain = EveryEntryPoint(kl_value)(*[t.detach() for t in tensors], idx, *cus,
                                      tuple(torch.zeros(()) for _ in range(3)))
    assert not torch.allclose(got[0], plain[0])
