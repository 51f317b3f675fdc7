"""Packed sequences (cu_seqlens) on the kernels (H200): one sequence at a time (flash_msa_rt.ops.packed) through the
torch.library ops, against the float64 reference run per sequence (flash_msa_rt.reference.varlen) under
flash_msa_rt.tolerances: empty sequences, a length-1 sequence, sequences shorter than a block, exactly a block, and
partial last blocks in one pack; G 1 and 4; bf16 and fp16; deterministic mode; 200 and 1,000 short documents; a pack
of one sequence equals the fixed-length call bitwise; selection, MSA, warmup and block-sparse attention through the
public API run on the kernels; a pack's deferred KL value comes from the backward's kl_value kernels."""

from __future__ import annotations

import pytest
import torch

import flash_msa_rt as F
from flash_msa_rt import reference, tolerances
from flash_msa_rt.ops import library
from flash_msa_rt.selftest import on_kernels, resolved_backends

pytestmark = pytest.mark.gpu

D, BS = 128, 128
LENGTHS = [0, 1, 100, 128, 300, 0, 700]  # empty, one token, < a block, a block, partial last blocks
NAMES = ("q_proxy", "k_proxy", "q", "k", "v")


def _pack(lengths, H, Hk, Hp, Hpk, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    ins = {n: torch.randn(1, total, h, D, device="cuda", generator=g).to(dtype)
           for n, h in zip(NAMES, (Hp, Hpk, H, Hk, Hk))}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    dout = torch.randn(1, total, H, D, device="cuda", generator=g).to(dtype)
    kl_grad = torch.rand(1, Hp, total, device="cuda", generator=g) + 0.5
    return ins, cu, dout, kl_grad


def _msa_on(ins, sel, cu, dout, kl_grad, scale):
    leaves = {n: t.detach().requires_grad_() for n, t in ins.items()}
    out, lse, lse_p, kl_rows = library.msa_forward(*leaves.values(), sel, BS, scale, cu)
    grads = torch.autograd.grad((out.float() * dout.float()).sum() + (kl_rows * kl_grad).sum(), list(leaves.values()))
    return {"out": out, "lse": lse, "lse_proxy": lse_p, "kl_rows": kl_rows,
            **{f"d{n}": g for n, g in zip(ins, grads)}}


def _msa_reference(ins, sel, cu, dout, kl_grad, scale, dt):
    x = [t.to(dt) for t in ins.values()]
    o, lse, lse_p, kl = reference.msa_forward_varlen(*x, sel, cu_seqlens=cu, block_size=BS, scale=scale)
    g = reference.msa_backward_varlen(*x, o, lse, lse_p, sel, BS, scale, grad_out=dout.to(dt), cu_seqlens=cu,
                                      kl_grad=kl_grad.to(dt))
    return {"out": o, "lse": lse, "lse_proxy": lse_p, "kl_rows": kl, **{f"d{n}": t for n, t in zip(ins, g)}}


def _assert_matches_reference(got, ins, sel, cu, dout, kl_grad, scale):
    """Every output and gradient of _msa_on within tolerances of the float64 reference (float32 as the baseline)."""
    want, base = (_msa_reference(ins, sel, cu, dout, kl_grad, scale, dt) for dt in (torch.float64, torch.float32))
    bad = []
    for name, g in got.items():
        stat = torch.float32 if name in ("lse", "lse_proxy", "kl_rows") else None
        c = tolerances.check(name, g, want[name], base[name], result_dtype=stat)
        if not c.ok:
            bad.append(str(c))
    assert not bad, bad


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("H, Hk, Hp, Hpk", [(4, 4, 4, 1), (8, 2, 2, 1)], ids=["G1", "G4"])
def test_packed_msa_matches_the_reference_per_sequence(H, Hk, Hp, Hpk, dtype, deterministic):
    ins, cu, dout, kl_grad = _pack(LENGTHS, H, Hk, Hp, Hpk, dtype, seed=H + Hp)
    scale = D ** -0.5
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        with resolved_backends() as seen:
            sel = library.select_blocks(ins["q_proxy"], ins["k_proxy"], 3, BS, scale, cu)
            got = _msa_on(ins, sel, cu, dout, kl_grad, scale)
            again = _msa_on(ins, sel, cu, dout, kl_grad, scale) if deterministic else None
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(before)
    assert on_kernels(seen, ("select_blocks", "msa_forward", "msa_backward")) is None, seen
    _assert_matches_reference(got, ins, sel, cu, dout, kl_grad, scale)
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(got.values(), again.values())), "not bitwise repeatable"
    # the selection is each sequence's own: its local block present, nothing past it
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            local = (torch.arange(b - a, device="cuda") // BS).view(1, 1, -1, 1)
            s = sel[:, :, a:b].long()
            assert ((s == local).any(-1)).all() and not ((s > local) & (s >= 0)).any()


def test_a_thousand_short_documents_match_the_reference_per_sequence():
    """1,000 documents of 1..300 tokens in one pack (most share one padded call, tuning.packed): selection, forward
    with the KL pass and backward on the kernels against the float64 reference run per sequence."""
    lengths = [int(n) for n in torch.randint(1, 301, (1000,), generator=torch.Generator().manual_seed(3))]
    ins, cu, dout, kl_grad = _pack(lengths, 8, 2, 2, 1, torch.bfloat16, seed=31)
    scale = D ** -0.5
    with resolved_backends() as seen:
        sel = library.select_blocks(ins["q_proxy"], ins["k_proxy"], 3, BS, scale, cu)
        got = _msa_on(ins, sel, cu, dout, kl_grad, scale)
    torch.cuda.synchronize()
    assert on_kernels(seen, ("select_blocks", "msa_forward", "msa_backward")) is None, seen
    _assert_matches_reference(got, ins, sel, cu, dout, kl_grad, scale)


def test_one_sequence_is_the_fixed_length_call_bitwise():
    ins, cu, dout, kl_grad = _pack([1000], 8, 2, 2, 1, torch.bfloat16, seed=5)
    scale = D ** -0.5
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        sel = library.select_blocks(ins["q_proxy"], ins["k_proxy"], 3, BS, scale, None)
        assert torch.equal(sel, library.select_blocks(ins["q_proxy"], ins["k_proxy"], 3, BS, scale, cu))
        packed, fixed = (_msa_on(ins, sel, c, dout, kl_grad, scale) for c in (cu, None))
    finally:
        torch.use_deterministic_algorithms(False)
    for name in packed:
        assert torch.equal(packed[name], fixed[name]), name


def test_public_varlen_entry_points_run_on_the_kernels():
    """200 short documents (one empty, one of 513 tokens) through flash_msa_varlen_func and its warmup form, forward
    and backward, on the kernels; and block-sparse attention on the same pack against the reference."""
    lengths = [int(n) for n in torch.randint(1, 90, (200,), generator=torch.Generator().manual_seed(0))]
    lengths[17] = 0
    lengths[50] = 513
    ins, cu, dout, _ = _pack(lengths, 8, 2, 2, 1, torch.bfloat16, seed=7)
    flat = {n: t[0].detach().requires_grad_() for n, t in ins.items()}
    with resolved_backends() as seen:
        out, kl = F.flash_msa_varlen_func(*flat.values(), cu, max(lengths), 256)
        (out.float() * dout[0].float()).sum().add(kl).backward()
        w_out, w_kl = F.flash_msa_warmup_varlen_func(*flat.values(), cu, max(lengths), 256)
        (w_out.float() * dout[0].float()).sum().add(w_kl).backward()
        idx = library.select_blocks(ins["k"], ins["k"], 2, BS, D ** -0.5, cu)  # valid (1, Hk, total, 2) indices
        b_out, b_lse = library.block_sparse_forward(ins["q"], ins["k"], ins["v"], idx, BS, 0.1, cu)
    torch.cuda.synchronize()
    ops = ("select_blocks", "msa_forward", "msa_backward", "warmup_forward", "warmup_backward",
           "block_sparse_forward")
    assert on_kernels(seen, ops) is None, seen
    assert torch.isfinite(kl) and torch.isfinite(w_kl) and kl > 0 and w_kl > 0
    for name, t in flat.items():
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
    x64 = [ins[n].double() for n in ("q", "k", "v")]
    x32 = [ins[n].float() for n in ("q", "k", "v")]
    want = reference.block_sparse_forward_varlen(*x64, idx, cu_seqlens=cu, block_size=BS, scale=0.1)
    base = reference.block_sparse_forward_varlen(*x32, idx, cu_seqlens=cu, block_size=BS, scale=0.1)
    tolerances.assert_ok(tolerances.check("block_sparse out", b_out, want[0], base[0]))
    tolerances.assert_ok(tolerances.check("block_sparse lse", b_lse, want[1], base[1], result_dtype=torch.float32))


def test_a_one_token_document_keeps_warmup_on_cudnn():
    """cuDNN refuses s_q = s_kv = 1: a packed document of one token runs on the sparse kernels for that call, and
    the device is not marked as refusing cuDNN (the next pack's long documents still use it)."""
    import warnings

    from flash_msa_rt.ops import kernels

    ins, cu, dout, _ = _pack([1, 300], 8, 2, 2, 1, torch.bfloat16, seed=9)
    flat = [t[0].detach().requires_grad_() for t in ins.values()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "cuDNN attention failed" would raise
        out, kl = F.flash_msa_warmup_varlen_func(*flat, cu, 300, 256)
        (out.float() * dout[0].float()).sum().add(kl).backward()
    assert not kernels._cudnn_failed and kernels._dense_main(ins["q"])


def _varlen_step(fn, leaves, cu, max_seqlen, dout, top_k):
    out, kl = fn(*leaves, cu, max_seqlen, top_k)
    grads = torch.autograd.grad((out.float() * dout).sum() + kl, leaves)
    return (out, kl, *grads)


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "warmup"])
def test_a_packed_step_captures_in_a_cuda_graph_and_replays_new_offsets(sparse):
    """A packed forward + backward through the varlen entry point issues no host read of cu_seqlens under capture
    (the pack is planned on the device from max_seqlen): captured once, replayed with other lengths of the same
    count and new inputs, it matches the float64 reference on those; offsets with a sequence longer than
    max_seqlen (which raise when eager) make every output NaN on replay. Warmup's inputs are scaled so that a
    padded row's exp(score) would overflow fp32 unless its lse is padded with +inf."""
    fn = F.flash_msa_varlen_func if sparse else F.flash_msa_warmup_varlen_func
    H, Hk, Hp, Hpk, dtype, max_seqlen, top_k = 8, 2, 2, 1, torch.bfloat16, 700, 384
    first, second = [300, 0, 1, 700, 128], [128, 700, 0, 300, 1]
    total = sum(first)
    amp = 1.0 if sparse else 6.0

    def inputs(lengths, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        xs = [(torch.randn(total, h, D, device="cuda", generator=g) * amp).to(dtype) for h in (Hp, Hpk, H, Hk, Hk)]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        return xs, cu, torch.randn(total, H * D, device="cuda", generator=g).view(total, H, D)

    xs, cu, dout = inputs(first, 1)
    leaves = [x.clone().requires_grad_() for x in xs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _varlen_step(fn, leaves, cu, max_seqlen, dout, top_k)  # loads every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _varlen_step(fn, leaves, cu, max_seqlen, dout, top_k)
    xs2, cu2, dout2 = inputs(second, 2)
    with torch.no_grad():
        for leaf, x in zip(leaves, xs2):
            leaf.copy_(x)
    cu.copy_(cu2)
    dout.copy_(dout2)
    graph.replay()
    torch.cuda.synchronize()

    def reference_step(dt):
        ref = [x.cpu().to(dt).requires_grad_() for x in xs2]
        return _varlen_step(fn, ref, cu2.cpu(), max_seqlen, dout2.cpu().to(dt), top_k)

    want, base = reference_step(torch.float64), reference_step(torch.float32)
    bad = []
    for name, g, w, b in zip(("out", "kl_loss", *(f"d{n}" for n in NAMES)), static, want, base):
        c = tolerances.check(name, g.cpu().reshape(w.shape), w, b,
                             result_dtype=torch.float32 if name == "kl_loss" else dtype)
        if not c.ok:
            bad.append(str(c))
    assert not bad, bad
    cu.copy_(torch.tensor([0, total, total, total, total, total], dtype=torch.int32))  # total > max_seqlen
    graph.replay()
    torch.cuda.synchronize()
    assert static[0].isnan().all() and static[1].isnan()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_separate_key_offsets_on_the_kernels(dtype):
    """A context-parallel rank's two zigzag-like query chunks (rows 100..250 and 700..900 of a 900-token sequence,
    not block-aligned) against the one key tensor (cu_seqlens_k repeats its start, seqused_k the chunks' ends) on
    the kernels (tuning.packed separate_keys="kernels": selection and the sparse ops take each chunk unpadded, the
    kernels' query offset; warmup front-pads it to its keys): the selection equals
    the fixed-length kernel's on the whole sequence row for row, bitwise (a row depends on its own query and the
    keys only); forward, KL rows and backward on that selection match the float64 reference; warmup likewise."""
    from flash_msa_rt import tuning

    H, Hk, Hp, Hpk, L, scale = 8, 2, 2, 1, 900, D ** -0.5
    chunks = [(100, 250), (700, 900)]
    full, _, _, _ = _pack([L], H, Hk, Hp, Hpk, dtype, seed=21)
    rows = lambda t, dim=1: torch.cat([t.narrow(dim, a, b - a) for a, b in chunks], dim=dim)  # noqa: E731
    ins = {n: (rows(t) if n in ("q_proxy", "q") else t) for n, t in full.items()}
    total_q = sum(b - a for a, b in chunks)
    cu = torch.tensor([0, 150, total_q], dtype=torch.int32, device="cuda")
    keys = {"cu_seqlens_k": torch.tensor([0, 0, L], dtype=torch.int32, device="cuda"),
            "seqused_k": torch.tensor([b for _, b in chunks], dtype=torch.int32, device="cuda")}
    g = torch.Generator(device="cuda").manual_seed(22)
    dout = torch.randn(1, total_q, H, D, device="cuda", generator=g).to(dtype)
    kl_grad = torch.rand(1, Hp, total_q, device="cuda", generator=g) + 0.5
    with tuning.override(packed={"separate_keys": "kernels"}), resolved_backends() as seen:
        sel = library.select_blocks(ins["q_proxy"], ins["k_proxy"], 3, BS, scale, cu, **keys)
        whole = library.select_blocks(full["q_proxy"], full["k_proxy"], 3, BS, scale)
        leaves = {n: t.detach().requires_grad_() for n, t in ins.items()}
        out, lse, lse_p, kl_rows = library.msa_forward(*leaves.values(), sel, BS, scale, cu, **keys)
        grads = torch.autograd.grad((out.float() * dout.float()).sum() + (kl_rows * kl_grad).sum(),
                                    list(leaves.values()))
        w_leaves = {n: t.detach().requires_grad_() for n, t in ins.items()}
        w_out, w_kl = F.flash_msa_warmup_varlen_func(*(t[0] for t in w_leaves.values()), cu, 200, 384,
                                                     cu_seqlens_k=keys["cu_seqlens_k"], max_seqlen_k=L,
                                                     seqused_k=keys["seqused_k"])
        w_grads = torch.autograd.grad((w_out.float() * dout[0].float()).sum() + w_kl, list(w_leaves.values()))
    torch.cuda.synchronize()
    assert on_kernels(seen, ("select_blocks", "msa_forward", "msa_backward", "warmup_forward",
                             "warmup_backward")) is None, seen
    assert torch.equal(sel, rows(whole, 2)), "a chunk's selection differs from the whole sequence's rows"
    bad = []
    for dt_name, dt in (("want", torch.float64), ("base", torch.float32)):
        x = [t.to(dt) for t in ins.values()]
        o, lse_r, lse_pr, kl_r = reference.msa_forward_varlen(*x, sel, cu, BS, scale, **keys)
        gr = reference.msa_backward_varlen(*x, o, lse_r, lse_pr, sel, BS, scale, dout.to(dt), cu, kl_grad.to(dt),
                                           **keys)
        wr = [t.cpu().to(dt).squeeze(0).requires_grad_() for t in ins.values()]
        wo, wk = F.flash_msa_warmup_varlen_func(*wr, cu.cpu(), 200, 384, cu_seqlens_k=keys["cu_seqlens_k"].cpu(),
                                                max_seqlen_k=L, seqused_k=keys["seqused_k"].cpu())
        wg = torch.autograd.grad((wo * dout[0].cpu().to(dt)).sum() + wk, wr)
        if dt_name == "want":
            want = {"out": o, "lse": lse_r, "lse_proxy": lse_pr, "kl_rows": kl_r, "warmup out": wo, "warmup kl": wk,
                    **{f"d{n}": t for n, t in zip(NAMES, gr)}, **{f"warmup d{n}": t for n, t in zip(NAMES, wg)}}
        else:
            base = {"out": o, "lse": lse_r, "lse_proxy": lse_pr, "kl_rows": kl_r, "warmup out": wo, "warmup kl": wk,
                    **{f"d{n}": t for n, t in zip(NAMES, gr)}, **{f"warmup d{n}": t for n, t in zip(NAMES, wg)}}
    got = {"out": out, "lse": lse, "lse_proxy": lse_p, "kl_rows": kl_rows, "warmup out": w_out, "warmup kl": w_kl,
           **{f"d{n}": t for n, t in zip(NAMES, grads)},
           **{f"warmup d{n}": t.unsqueeze(0) if t.dim() == 3 else t for n, t in zip(NAMES, w_grads)}}
    for name, g_ in got.items():
        w, b = want[name], base[name]
        g_ = g_.reshape(w.shape).to(w.device) if g_.numel() == w.numel() else g_
        stat = torch.float32 if name in ("lse", "lse_proxy", "kl_rows", "warmup kl") else None
        c = tolerances.check(name, g_.cpu(), w.cpu(), b.cpu(), result_dtype=stat)
        if not c.ok:
            bad.append(str(c))
    assert not bad, bad


@pytest.mark.parametrize("separate_keys", [False, True], ids=["packed", "separate_keys"])
def test_side_streams_compute_what_one_stream_does(separate_keys):
    """tuning.packed streams: the pack's calls spread over 1, 2 and 4 side streams give the same selection, outputs
    and (deterministic mode) gradients, bit for bit; several calls per op (lengths in different buckets above the
    merge cap), and for separate key offsets a rank's two chunks against one key tensor."""
    from flash_msa_rt import tuning

    H, Hk, Hp, Hpk, scale = 8, 2, 2, 1, D ** -0.5
    lengths = [3000, 2300, 129, 5000, 2600] if not separate_keys else [2900]
    ins, cu, dout, kl_grad = _pack(lengths, H, Hk, Hp, Hpk, torch.bfloat16, seed=31)
    keys = {}
    if separate_keys:
        chunks = [(300, 700), (2100, 2900)]
        ins = {n: (torch.cat([t[:, a:b] for a, b in chunks], 1) if n in ("q_proxy", "q") else t)
               for n, t in ins.items()}
        total_q = sum(b - a for a, b in chunks)
        cu = torch.tensor([0, 400, total_q], dtype=torch.int32, device="cuda")
        keys = {"cu_seqlens_k": torch.tensor([0, 0, 2900], dtype=torch.int32, device="cuda"),
                "seqused_k": torch.tensor([b for _, b in chunks], dtype=torch.int32, device="cuda")}
        dout, kl_grad = dout[:, :total_q], kl_grad[:, :, :total_q].contiguous()
    results = {}
    torch.use_deterministic_algorithms(True)
    try:
        for streams in (1, 2, 4):
            with tuning.override(packed={"streams": streams}):
                sel = library.select_blocks(ins["q_proxy"], ins["k_proxy"], 4, BS, scale, cu, **keys)
                leaves = {n: t.detach().requires_grad_() for n, t in ins.items()}
                out, lse, lse_p, kl_rows = library.msa_forward(*leaves.values(), sel, BS, scale, cu, **keys)
                grads = torch.autograd.grad((out.float() * dout.float()).sum() + (kl_rows * kl_grad).sum(),
                                            list(leaves.values()))
                results[streams] = (sel, out, lse, lse_p, kl_rows, *grads)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()
    for streams in (2, 4):
        same = [torch.equal(a, b) for a, b in zip(results[1], results[streams])]
        assert all(same), (streams, same)


# warmup's backward has no deterministic kernels (dispatch runs the reference there): atomics only
@pytest.mark.parametrize("sparse, deterministic", [(True, False), (True, True), (False, False)],
                         ids=["sparse-atomics", "sparse-deterministic", "warmup-atomics"])
def test_a_packs_deferred_kl_comes_from_the_backward_and_equals_exact(launched_kernels, tuned, sparse,
                                                                       deterministic):
    """kl_value="deferred" on a pack (runs, a padded bucket, an empty and a one-token document): the value comes
    from the proxy backward's kl_value variant (packed_kl.PackKL: one mean over the pack's real rows), with no KL
    pass of its own in the backward, and equals exact mode's within 1e-3 relative; the gradients equal exact
    mode's up to the atomics' order (bitwise in deterministic mode)."""
    tuned(kl_value={"forward_pass_rows": 0})
    lengths = [300, 0, 200, 130, 1, 700, 700]
    ins, cu, dout, _ = _pack(lengths, 8, 2, 2, 1, torch.bfloat16, seed=21)
    fn = F.flash_msa_varlen_func if sparse else F.flash_msa_warmup_varlen_func
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    runs = {}
    try:
        for kl_value in ("exact", "deferred"):
            leaves = [t[0].clone().requires_grad_() for t in ins.values()]
            metric = torch.zeros((), device="cuda")
            del launched_kernels[:]
            out, kl = fn(*leaves, cu, max(lengths), 256, kl_metric=metric, kl_value=kl_value)
            ((out.float() * dout[0].float()).sum() + 0.3 * kl).backward()
            torch.cuda.synchronize()
            runs[kl_value] = (float(kl) if kl_value == "exact" else float(metric), [t.grad for t in leaves],
                              sorted(set(launched_kernels)))
    finally:
        torch.use_deterministic_algorithms(before)
    (exact, grads_e, _), (deferred, grads_d, names) = runs["exact"], runs["deferred"]
    family = "sparse" if sparse else "warmup"
    assert not any(n.startswith(f"{family}_kl_") and "_kl1_" in n for n in names), names
    assert any(n.startswith(f"{family}_bwd_proxy_") and "_kl1_" in n for n in names), names
    print(f"\n{family} pack: exact KL {exact:.6f}, deferred {deferred:.6f}")
    assert exact > 0 and abs(deferred - exact) <= 1e-3 * exact
    for name, e, d in zip(NAMES, grads_e, grads_d):
        if deterministic:
            assert torch.equal(e, d), f"d{name}: exact and deferred differ in deterministic mode"
        else:
            torch.testing.assert_close(d.float(), e.float(), rtol=2e-2, atol=2e-2 * e.float().abs().max())
