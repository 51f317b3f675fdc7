"""What the CUDA kernel backend declines, and why (no GPU needed: every case is decided before artifacts)."""

import pytest
import torch

from flash_msa_rt import tuning
from flash_msa_rt.ops import dispatch, kernels


def _problem(op="msa_backward", dtype=torch.bfloat16, **over):
    config = {"head_dim": 128, "proxy_head_dim": 128, "block_size": 128, "group": 4, "kv_group": 8,
              "varlen": False}
    if op == "msa_backward":
        config["deterministic"] = False
    config.update(over)
    return dispatch.Problem(op, torch.device("cuda", 0), dtype, config)


@pytest.mark.parametrize("over, words", [
    ({"group": 3}, "G 3"),
    ({"head_dim": 64}, "D 64"),
    ({"block_size": 64}, "block_size 64"),
    ({"kv_group": 2}, "Hp >= Hk"),
])
def test_sparse_kernels_decline_with_a_reason(over, words, catalogue_artifacts):
    """What the sparse kernels run is read from the manifest (here: the default sm90a build's): a problem outside it
    is declined naming the problem's value and what is built."""
    catalogue_artifacts("sm90a")
    reason = kernels._msa_supports(_problem(**over))
    assert reason is not None and words in reason
    if words.startswith(("G", "D", "block_size")):
        assert "built for sm90a" in reason and "G in (1, 2, 4, 8, 16)" in reason, reason


def test_separate_key_offsets_take_the_kernels_under_the_tuning_policy(catalogue_artifacts):
    """cu_seqlens_k / seqused_k: the kernels' path (packed.per_sequence: selection and the sparse MSA ops with the
    kernels' query offset, warmup with each query sequence front-padded to its keys) by default; tuning.packed
    "reference" keeps them on the reference and the reason says so."""
    catalogue_artifacts("sm90a")
    assert kernels._msa_supports(_problem(varlen=True, separate_keys=True)) is None
    select = _problem("select_blocks", varlen=True, separate_keys=True, top_k_blocks=16)
    assert kernels._select_supports(select) is None
    with tuning.override(packed={"separate_keys": "reference"}):
        reason = kernels._msa_supports(_problem(varlen=True, separate_keys=True))
        assert reason is not None and "cu_seqlens_k" in reason and "separate_keys" in reason


def test_every_default_problem_is_accepted_on_the_default_build(catalogue_artifacts):
    """Against the default sm90a build's manifest, dispatch finds every variant a default forward and backward
    launches (the loader's lookup by named fields), at every built G, deterministic or not, and the selection's;
    sm100a's build has no deterministic kernels."""
    catalogue_artifacts("sm90a")
    for G in (1, 2, 4, 8, 16):
        for op, det in (("msa_forward", False), ("msa_backward", False), ("msa_backward", True)):
            assert kernels._msa_supports(_problem(op, group=G, kv_group=G, deterministic=det)) is None, (op, G)
        assert kernels._warmup_supports(_problem("warmup_forward", group=G, kv_group=G)) is None, G
    for k in (1, 16, 17, 64):
        select = _problem("select_blocks", top_k_blocks=k)
        assert kernels._select_supports(select) is None, k
    assert "K 65" in kernels._select_supports(_problem("select_blocks", top_k_blocks=65))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_local_blocks_run_on_the_selection_kernel(monkeypatch, precision, catalogue_artifacts):
    """local_blocks > 1 is not declined (issue 58: the selection kernel's runtime scalar, no variant per L) and
    reaches the kernel's local_blocks param, after group in its ABI (kernels_src.select.params); the default is 1."""
    from flash_msa_rt.ops import select
    from kernels_src.select import Config, params

    catalogue_artifacts("sm90a")
    for L in (2, 3, 16):
        problem = _problem("select_blocks", top_k_blocks=16, local_blocks=L, select_precision=precision)
        assert kernels._select_supports(problem) is None, L
    for config in (Config(), Config(dtype="e4m3", mma="wgmma")):
        scalars = [(p.name, p.ctype) for p in params(config) if p.kind == "scalar"]
        assert scalars == [("scale", "f32"), ("group", "i32"), ("local_blocks", "i32")], scalars
    launched = []
    monkeypatch.setattr(select, "get_kernel", lambda op, config, device: lambda **kw: launched.append(kw))
    monkeypatch.setattr(select, "quantize", lambda q, k, bs, arch: (q, k, None))
    qp = torch.zeros(1, 300, 2, 128, dtype=torch.bfloat16)
    for L in (1, 3):
        kernels._select_blocks(qp, qp[:, :, :1], 4, 128, 0.1, precision=precision, local_blocks=L)
    kernels._select_blocks(qp, qp[:, :, :1], 4, 128, 0.1, precision=precision)
    assert [kw["local_blocks"] for kw in launched] == [1, 3, 1], launched


def test_the_variant_lookup_reads_named_fields(catalogue_artifacts):
    """The loader finds a variant by its config's named fields, whatever order the runtime writes them in (the
    build's declaration order names the variant); a field of another value is missing, with the nearest ones."""
    from flash_msa_rt import loader
    from flash_msa_rt.errors import MissingVariantError
    from flash_msa_rt.ops import sparse_fwd

    catalogue_artifacts("sm90a")
    config = sparse_fwd.kernel_config("bf16", 128, 128, 4, sparse_fwd.choice("sm90a", 4))
    entry, _ = loader.find_variant("sparse_fwd", config, "sm90a")
    shuffled = dict(reversed(list(config.items())))
    assert list(shuffled) != list(config) and loader.find_variant("sparse_fwd", shuffled, "sm90a")[0] is entry
    assert loader.built_values("sparse_fwd", "group", "sm90a", dtype="bf16") == (1, 2, 4, 8, 16)
    with pytest.raises(MissingVariantError, match="nearest available"):
        loader.find_variant("sparse_fwd", dict(shuffled, group=3), "sm90a")


def test_deterministic_backward_is_declined_off_the_tau_path(monkeypatch):
    """Under deterministic algorithms the backward runs the tau path's deterministic kernels (wgmma, sm90a); on
    sm100a (mma.sync) it is declined with the reason, and warned about once."""
    from flash_msa_rt import loader

    monkeypatch.setattr(loader, "device_arch", lambda index: "sm100a")
    with pytest.warns(RuntimeWarning):  # the autouse fixture re-armed the warning
        reason = kernels._msa_supports(_problem(deterministic=True))
    assert "use_deterministic_algorithms" in reason and "sm100a" in reason and "reference" in reason
    monkeypatch.setattr(loader, "device_arch", lambda index: "sm90a")
    reason = kernels._msa_supports(_problem(deterministic=True))  # only the artifacts can decline it here
    assert reason is None or "use_deterministic_algorithms" not in reason
    # warmup's backward has no deterministic kernels on any arch
    reason = kernels._warmup_supports(_problem("warmup_backward", deterministic=True))
    assert "use_deterministic_algorithms" in reason and "warmup" in reason


def test_float32_is_declined():
    assert "float32" in kernels._msa_supports(_problem("msa_forward", dtype=torch.float32))


def test_reset_warnings_rearms_every_once_per_process_warning():
    """dispatch.reset_warnings re-arms deterministic mode's warning (and forgets the cuDNN refusals), so that the
    next decline warns again."""
    import warnings

    from flash_msa_rt import loader
    from flash_msa_rt.ops import dispatch

    with pytest.MonkeyPatch.context() as m, warnings.catch_warnings(record=True) as recwarn:
        warnings.simplefilter("always")
        m.setattr(loader, "device_arch", lambda index: "sm100a")
        for _ in range(2):
            kernels._msa_supports(_problem(deterministic=True))
        assert len(recwarn) == 1
        kernels._cudnn_failed[0] = RuntimeError("refused")
        dispatch.reset_warnings()
        assert not kernels._cudnn_failed
        kernels._msa_supports(_problem(deterministic=True))
        assert len(recwarn) == 2


@pytest.mark.parametrize("first", ["flash_msa_rt.ops.kernels", "flash_msa_rt.ops.dispatch", "flash_msa_rt"])
def test_kernel_backend_registers_once_whatever_is_imported_first(first):
    """dispatch registers the kernel backend (kernels does not import dispatch): whatever is imported first,
    exactly one kernel backend comes before the reference."""
    import subprocess
    import sys

    code = (f"import {first}\nfrom flash_msa_rt.ops import dispatch\n"
            "print(','.join(b.name for b in dispatch.backends()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "kernels,reference"


@pytest.mark.parametrize("S", [1, 127, 128, 129, 1000, 4096])
@pytest.mark.parametrize("D", [128, 256])
def test_warmup_entry_count_matches_the_all_causal_selection(S, D):
    """_warmup_entries (the int32 guard of the sparse main path) counts the live slots of _all_causal_blocks, on
    the main kernels' blocks (64 at D 256)."""
    q_proxy = torch.empty(2, S, 3, 8)
    bs = kernels._warmup_block(torch.empty(1, 1, 1, D))
    assert bs == (64 if D == 256 else kernels.WARMUP_BLOCK)
    sel = kernels._all_causal_blocks(q_proxy, bs)
    assert sel.shape == (2, 3, S, -(-S // bs))
    i = torch.arange(S).view(1, 1, S, 1)
    want = (torch.arange(sel.shape[3]).view(1, 1, 1, -1) <= i // bs).expand(sel.shape)
    assert torch.equal(sel >= 0, want)
    assert kernels._warmup_entries(q_proxy, bs) == int((sel >= 0).sum())


def test_all_causal_blocks_are_made_per_slice():
    """AllCausalBlocks hands out the rows [s0, s1) of the whole selection, and refuses any other indexing."""
    q_proxy = torch.empty(2, 1000, 3, 8)
    lazy = kernels.AllCausalBlocks(q_proxy, kernels.WARMUP_BLOCK)
    whole = kernels._all_causal_blocks(q_proxy, kernels.WARMUP_BLOCK)
    assert lazy.shape == tuple(whole.shape)
    for s0, s1 in ((0, 1000), (0, 128), (128, 600), (999, 1000), (500, 500)):
        assert torch.equal(lazy[:, :, s0:s1].contiguous(), whole[:, :, s0:s1])
    with pytest.raises(TypeError, match="AllCausalBlocks supports"):
        lazy[0]


def test_cudnn_operators_for_warmup_are_checked_by_schema(monkeypatch):
    """Warmup's dense main attention needs torch's cuDNN attention operators with the argument lists it calls;
    a torch without them (or with other arguments) is reported, and warmup then stays on the sparse kernels."""
    from flash_msa_rt.ops import dense_main

    assert dense_main.available() is None, "the torch this project pins has both operators"
    monkeypatch.setattr(dense_main, "_BWD_ARGS", dense_main._BWD_ARGS + ("no_such_argument",))
    reason = dense_main.available()
    assert reason is not None and "_scaled_dot_product_cudnn_attention_backward" in reason
    monkeypatch.setattr(kernels.torch.backends.cudnn, "is_available", lambda: True)
    assert not kernels._dense_main(torch.empty(1))


def test_warmup_falls_back_to_the_sparse_main_path_when_cudnn_refuses(monkeypatch):
    """A cuDNN that refuses its attention (e.g. no SDPA support) must not break warmup mode: the call runs the
    main attention on the sparse kernels instead, says so once, and the device stays on that path (forward and
    backward). Checked with the GPU calls replaced by recorders."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append("cudnn")
        raise RuntimeError("cuDNN Frontend error: no valid engine configs")

    monkeypatch.setattr(kernels.dense_main, "available", lambda: None)
    monkeypatch.setattr(kernels.torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(kernels.dense_main, "dense_forward", refuse)
    monkeypatch.setattr(kernels.dense_main, "dense_backward", refuse)
    monkeypatch.setattr(kernels, "_msa_forward", lambda *a, **kw: calls.append("sparse_fwd") or "fwd")
    monkeypatch.setattr(kernels, "_msa_backward", lambda *a, **kw: calls.append("sparse_bwd") or "bwd")
    qp = torch.zeros(1, 300, 2, 128)
    q = torch.zeros(1, 300, 8, 128)
    with pytest.warns(RuntimeWarning, match="cuDNN attention failed"):
        assert kernels._warmup_forward(qp, qp, q, qp, qp, 0.1) == "fwd"
    assert calls == ["cudnn", "sparse_fwd"]
    assert not kernels._dense_main(q)  # remembered: the next calls go straight to the sparse path
    assert kernels._warmup_backward(qp, qp, q, qp, qp, q, None, None, 0.1, q, None) == "bwd"
    assert calls == ["cudnn", "sparse_fwd", "sparse_bwd"]


def test_warmup_backward_falls_back_when_only_cudnn_backward_refuses(monkeypatch):
    """out and lse are exact whichever path made them: a cuDNN forward followed by a refused cuDNN backward runs
    the sparse backward on them."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append("cudnn_bwd")
        raise RuntimeError("cuDNN Frontend error")

    monkeypatch.setattr(kernels.dense_main, "available", lambda: None)
    monkeypatch.setattr(kernels.torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(kernels.dense_main, "dense_backward", refuse)
    monkeypatch.setattr(kernels, "_msa_backward", lambda *a, **kw: calls.append("sparse_bwd") or "bwd")
    qp = torch.zeros(1, 300, 2, 128)
    q = torch.zeros(1, 300, 8, 128)
    with pytest.warns(RuntimeWarning, match="cuDNN attention failed"):
        assert kernels._warmup_backward(qp, qp, q, qp, qp, q, None, None, 0.1, q, None) == "bwd"
    assert calls == ["cudnn_bwd", "sparse_bwd"]


@pytest.mark.parametrize("dense_built", [True, False])
def test_warmup_proxy_passes_take_the_dense_kernels_where_usable(monkeypatch, dense_built):
    """Warmup's KL pass and proxy backward run the dense kernels (flash_msa_rt.ops.warmup_kl) when `usable` says
    so, and the sparse kernels over the all-causal selection otherwise or when tuning.warmup's dense_proxy is
    overridden off. Checked with the GPU calls replaced by recorders."""
    from flash_msa_rt import tuning
    from flash_msa_rt.ops import warmup_kl

    calls = []
    monkeypatch.setattr(kernels.dense_main, "available", lambda: None)
    monkeypatch.setattr(kernels.torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(kernels.dense_main, "dense_forward", lambda *a: ("out", "lse"))
    monkeypatch.setattr(kernels.dense_main, "dense_backward", lambda *a: ("dq", "dk", "dv"))
    monkeypatch.setattr(warmup_kl, "usable", lambda qp, q, op="warmup_kl": None if dense_built else "not built")
    monkeypatch.setattr(warmup_kl, "warmup_kl_cuda", lambda *a: calls.append("dense_kl") or ("lp", "kl"))
    monkeypatch.setattr(warmup_kl, "warmup_proxy_backward_cuda",
                        lambda *a, **kw: calls.append("dense_bwd") or ("dqp", "dkp"))
    monkeypatch.setattr(kernels.sparse_fwd, "msa_kl_cuda", lambda *a, **kw: calls.append("sparse_kl") or ("lp", "kl"))
    monkeypatch.setattr(kernels.sparse_bwd, "proxy_backward_cuda",
                        lambda *a, **kw: calls.append("sparse_bwd") or ("dqp", "dkp"))
    qp = torch.zeros(1, 300, 2, 128)
    q = torch.zeros(1, 300, 8, 128)
    for dense_switch in (True, False):
        calls.clear()
        with tuning.override(warmup={"dense_proxy": dense_switch}):
            assert kernels._warmup_forward(qp, qp, q, qp, qp, 0.1) == ("out", "lse", "lp", "kl")
            assert kernels._warmup_backward(qp, qp, q, qp, qp, q, "lse", "lp", 0.1, q, torch.ones(())) == (
                "dqp", "dkp", "dq", "dk", "dv")
        dense = dense_built and dense_switch
        assert calls == (["dense_kl", "dense_bwd"] if dense else ["sparse_kl", "sparse_bwd"]), (dense_built,
                                                                                                dense_switch)


@pytest.mark.parametrize("dense", [True, False], ids=["dense-warmup", "sparse-warmup"])
def test_proxy_scale_reaches_every_launcher(monkeypatch, dense, catalogue_artifacts):
    """proxy_scale != scale runs on the kernels (no decline), and every kernel-backend op hands it to each proxy
    launcher it calls (the KL passes, the proxy lse alone, the proxy backwards), beside the main scale. Checked
    with the GPU calls replaced by recorders; warmup on cuDNN with the dense proxy kernels, or on the sparse ones."""
    from flash_msa_rt.ops import warmup_kl

    catalogue_artifacts("sm90a")
    for op in ("msa_forward", "msa_backward", "msa_kl", "warmup_forward", "warmup_backward", "warmup_kl"):
        assert kernels._supports(_problem(op, proxy_scale=True, deterministic=False)) is None, op
    seen = []

    def rec(name, ret, at=None):
        def run(*a, **kw):
            seen.append((name, kw["proxy_scale"] if "proxy_scale" in kw else a[at]))
            return ret
        return run

    qp, q = torch.zeros(1, 300, 2, 128), torch.zeros(1, 300, 8, 128)
    rows = (torch.zeros(1, 2, 300), torch.zeros(1, 2, 300))
    monkeypatch.setattr(kernels.dense_main, "available", lambda: None if dense else "no cuDNN")
    monkeypatch.setattr(kernels.torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(kernels.dense_main, "dense_forward", lambda *a: ("out", "lse"))
    monkeypatch.setattr(kernels.dense_main, "dense_backward", lambda *a: ("dq", "dk", "dv"))
    monkeypatch.setattr(warmup_kl, "usable", lambda qp, q, op="warmup_kl": None)
    monkeypatch.setattr(warmup_kl, "warmup_kl_cuda", rec("warmup_kl", rows, at=6))
    monkeypatch.setattr(warmup_kl, "warmup_lse_cuda", rec("warmup_lse", rows[0], at=2))
    monkeypatch.setattr(warmup_kl, "warmup_proxy_backward_cuda", rec("warmup_bwd_proxy", ("dqp", "dkp")))
    monkeypatch.setattr(kernels.sparse_fwd, "msa_forward_cuda", rec("msa_forward", ("out", "lse", *rows)))
    monkeypatch.setattr(kernels.sparse_fwd, "msa_kl_cuda", rec("msa_kl", rows))
    monkeypatch.setattr(kernels.sparse_bwd, "msa_backward_cuda", rec("msa_backward", ("dqp", "dkp", "dq", "dk", "dv")))
    monkeypatch.setattr(kernels.sparse_bwd, "tau_path_runs", lambda *a: True)
    idx = torch.zeros(1, 2, 300, 2, dtype=torch.int32)
    metric = torch.zeros(())
    kernels._msa_forward(qp, qp, q, qp, qp, idx, 128, 0.1, proxy_scale=0.7)
    kernels._msa_kl(qp, qp, q, qp, qp, "lse", idx, 128, 0.1, with_kl=False, proxy_scale=0.7)
    kernels._msa_backward(qp, qp, q, qp, qp, q, "lse", "lp", idx, 128, 0.1, q, torch.ones(()), kl_metric=metric,
                          proxy_scale=0.7)
    kernels._warmup_forward(qp, qp, q, qp, qp, 0.1, proxy_scale=0.7)
    kernels._warmup_kl(qp, qp, q, qp, qp, "lse", 0.1, with_kl=False, proxy_scale=0.7)
    kernels._warmup_kl(qp, qp, q, qp, qp, "lse", 0.1, proxy_scale=0.7)
    kernels._warmup_backward(qp, qp, q, qp, qp, q, "lse", "lp", 0.1, q, torch.ones(()), proxy_scale=0.7)
    assert seen and all(ps == 0.7 for _, ps in seen), seen
    names = {n for n, _ in seen}
    assert ({"warmup_kl", "warmup_lse", "warmup_bwd_proxy"} <= names) == dense, names
    assert {"msa_forward", "msa_kl", "msa_backward"} <= names, names


def test_warmup_main_attention_override_takes_the_sparse_path(monkeypatch):
    """tuning.warmup's dense_main overridden off runs warmup's main attention on the sparse kernels even where
    cuDNN is usable (the GPU tests' way to check that path)."""
    from flash_msa_rt import tuning

    monkeypatch.setattr(kernels.dense_main, "available", lambda: None)
    monkeypatch.setattr(kernels.torch.backends.cudnn, "is_available", lambda: True)
    q = torch.zeros(1, 300, 8, 128)
    assert kernels._dense_main(q)
    with tuning.override(warmup={"dense_main": False}):
        assert not kernels._dense_main(q)


def test_dense_warmup_kernels_say_why_not(catalogue_artifacts):
    """warmup_kl.usable names what it cannot run: the dtype and head dims, a tensor off CUDA, a group the proxy
    backward's chunks do not divide; and, from the manifest, a group the KL pass is not built for."""
    from flash_msa_rt.ops import warmup_kl

    qp = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    q8 = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)
    assert "runs on CUDA devices" in warmup_kl.usable(qp, q8, "warmup_bwd_proxy")
    assert "Dp 64" in warmup_kl.usable(torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16), q8[:, :, :4])
    assert "torch.float32" in warmup_kl.usable(qp.float(), q8[:, :, :4].float())
    catalogue_artifacts("sm90a")
    warmup_kl._built.cache_clear()
    try:
        why = warmup_kl._built("warmup_kl", "bf16", 128, 8, "pingpong", 0)
        assert "G 8" in why and "G in (1, 2, 4)" in why, why
        assert warmup_kl._built("warmup_kl", "bf16", 128, 4, "pingpong", 0) is None
    finally:
        warmup_kl._built.cache_clear()


def test_dense_warmup_kernels_need_their_variant(monkeypatch, tmp_path):
    """Without the variant in the device's artifacts (sm100a builds none) the dense warmup kernels decline with
    the loader's message (which names the build command). The verdict is cached per device."""
    from flash_msa_rt import loader
    from flash_msa_rt.ops import warmup_kl

    monkeypatch.setenv("FLASH_MSA_ARTIFACT_DIR", str(tmp_path))  # an empty artifact folder
    warmup_kl._built.cache_clear()
    try:
        monkeypatch.setattr(loader, "device_arch", lambda index: "sm100a")
        assert "not built for sm100a" in warmup_kl._built("warmup_kl", "bf16", 128, 4, "pingpong", 0)
        monkeypatch.setattr(loader, "device_arch", lambda index: "sm90a")
        why = warmup_kl._built("warmup_bwd_proxy", "bf16", 128, 4, "", 1)
        assert "python -m build_tools build" in why, why
        monkeypatch.setattr(loader, "device_arch", lambda index: "sm100a")
        assert warmup_kl._built("warmup_bwd_proxy", "bf16", 128, 4, "", 1) == why  # cached for device 1
    finally:
        warmup_kl._built.cache_clear()


def test_packed_sequences_run_as_runs_of_views():
    """cu_seqlens on the kernel backend, an op that takes runs only (warmup's): each run of consecutive equal-length
    sequences is one fixed-length call on views of the pack (its tokens only; a full-sized per-row kl_grad sliced, a
    broadcast one passed as is), the results concatenated along the tokens; an all-empty pack goes to the reference.
    Checked with the fixed-length op replaced by a recorder."""
    from flash_msa_rt.ops import packed

    seen = []

    def fixed(qp, kp, q, k, v, out, lse, lse_p, scale, grad_out, kl_grad, cu_seqlens=None):
        assert cu_seqlens is None
        seen.append((q.shape[1], lse.shape[2], None if kl_grad is None else tuple(kl_grad.shape)))
        return tuple(torch.full_like(t, float(q.shape[1])) for t in (qp, kp, q, k, v))

    run = packed.per_sequence("warmup_backward", fixed, lambda *a: "reference")
    total, Hp, H = 10, 2, 4
    t = lambda h: torch.zeros(1, total, h, 8)  # noqa: E731
    args = [t(Hp), t(1), t(H), t(2), t(2), t(H), torch.zeros(1, H, total), torch.zeros(1, Hp, total), 0.1, t(H),
            torch.ones(1, Hp, total)]
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    grads = run(*args, cu)
    assert seen == [(3, 3, (1, Hp, 3)), (7, 7, (1, Hp, 7))]
    seen.clear()  # consecutive equal lengths: one batch (B = 2 rows of 4 tokens, then 1 of 2), views of the pack
    batched = run(*args, torch.tensor([0, 4, 8, 10], dtype=torch.int32))
    assert seen == [(4, 4, (2, Hp, 4)), (2, 2, (1, Hp, 2))]
    assert [g.shape for g in batched] == [a.shape for a in args[:5]] and batched[2][0, :8].eq(4).all()
    assert [g.shape[1] for g in grads] == [total] * 5 and grads[2][0, :3].eq(3).all() and grads[2][0, 3:].eq(7).all()
    seen.clear()
    run(*args[:-1], torch.ones(()), cu)  # a broadcast kl_grad reaches every sequence whole
    assert [s[2] for s in seen] == [(), ()]
    assert run(*args, torch.tensor([0, 0], dtype=torch.int32)) == "reference"


def test_packed_sparse_ops_pad_different_lengths_into_one_call():
    """The sparse ops: sequences of different lengths that round up to the same number of 128-token tiles share
    one call, each padded to that length (zeros, block indices -1, kl_grad 0), and only their own rows come back,
    at their places; a run that has its padded length to itself stays a run of views."""
    from flash_msa_rt.ops import packed

    seen = []

    def fixed(qp, kp, q, k, v, out, lse, lse_p, sel, bs, scale, grad_out, kl_grad, cu_seqlens=None):
        seen.append((tuple(q.shape[:2]), sel.clone(), grad_out.clone(), kl_grad.clone()))
        return qp, kp, q * 2, k, v  # row for row: where a row comes back is visible

    run = packed.per_sequence("msa_backward", fixed, None)
    lengths = [3, 7, 3, 300]  # 3, 7 and 3 share a 128-row call; 300 runs alone on views
    total, Hp, H = sum(lengths), 2, 4
    g = torch.Generator().manual_seed(0)
    t = lambda h: torch.randn(1, total, h, 8, generator=g)  # noqa: E731
    q = t(H)
    args = [t(Hp), t(1), q, t(2), t(2), t(H), torch.zeros(1, H, total), torch.zeros(1, Hp, total),
            torch.zeros(1, Hp, total, 3, dtype=torch.int32), 128, 0.1, torch.ones(1, total, H, 8),
            torch.ones(1, Hp, total)]
    cu = torch.tensor([0, 3, 10, 13, 313], dtype=torch.int32)
    with tuning.override(packed={"merge_max_length": 0}):  # no bucket joins a longer one
        grads = run(*args, cu)
    assert [s[0] for s in seen] == [(3, 128), (1, 300)]
    _, sel, dout, kl_grad = seen[0]
    for row, n in enumerate((3, 7, 3)):
        assert sel[row, :, :n].eq(0).all() and sel[row, :, n:].eq(-1).all()
        assert dout[row, :n].eq(1).all() and dout[row, n:].eq(0).all()
        assert kl_grad[row, :, :n].eq(1).all() and kl_grad[row, :, n:].eq(0).all()
    torch.testing.assert_close(grads[2], q * 2, rtol=0, atol=0)
    assert packed.batches([(0, 3), (3, 10)], paddable=False) == [packed.Batch(0, 3, 1), packed.Batch(3, 7, 1)]


def test_short_buckets_join_longer_ones_while_padding_costs_less_than_a_call():
    """A bucket joins the next longer one where padding its sequences there adds at most call_pairs causal pairs
    (tuning.packed): short documents share one call, a long one never pads them to its length; through
    per_sequence, 3, 7, 3 and 300 tokens become one call of four rows of 384."""
    from flash_msa_rt.ops import packed

    def spans(lengths):
        ends = torch.tensor(lengths).cumsum(0).tolist()
        return [(e - n, e) for n, e in zip(lengths, ends)]

    short = [128, 200, 300, 500, 130, 1000]
    got = packed.batches(spans(short + [65536]), paddable=True, call_pairs=1 << 24, merge_max_length=2048)
    assert [(b.length, b.count) for b in got] == [(1024, 6), (65536, 1)]
    longer = packed.batches(spans([3000, 3100, 3500]), paddable=True, call_pairs=1 << 24, merge_max_length=2048)
    assert [b.length for b in longer] == [3000, 3100, 3500]  # above merge_max_length: no merge
    assert len(packed.batches(spans([3000, 3100, 3500]), paddable=True, call_pairs=1 << 24,
                              merge_max_length=4096)) == 1
    assert [b.length for b in packed.batches(spans(short), paddable=True, call_pairs=0)] == [128, 256, 300, 500, 1000]
    assert len(packed.batches(spans([128] * 200 + [1024]), paddable=True, call_pairs=1 << 24,
                              merge_max_length=2048)) == 2  # 200 x 512K pairs: too many
    seen = []
    run = packed.per_sequence("select_blocks", lambda qp, kp, *a, **k: seen.append(qp.shape[:2]) or
                              torch.zeros(qp.shape[0], 2, qp.shape[1], 1, dtype=torch.int32), None)
    run(torch.zeros(1, 313, 2, 8), torch.zeros(1, 313, 1, 8), 1, 64, 0.3,
        torch.tensor([0, 3, 10, 13, 313], dtype=torch.int32))
    assert seen == [(4, 384)]


def test_packed_runs_compute_the_varlen_contract():
    """packed.per_sequence around the fixed-length reference ops equals the varlen reference on a pack of runs of
    equal lengths, a lone sequence, an empty one and a partial block (float64, CPU): the batching of runs and the
    slicing of per-row tensors compute the contract, not only the right calls."""
    from flash_msa_rt import reference
    from flash_msa_rt.ops import packed

    g = torch.Generator().manual_seed(3)
    lengths = [130, 130, 130, 0, 57, 200, 200]
    total, Hp, H, D, BS = sum(lengths), 2, 4, 8, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = [torch.randn(1, total, h, D, generator=g, dtype=torch.float64) for h in (Hp, 1, H, 2, 2)]
    sel = reference.select_blocks_varlen(x[0], x[1], cu, 2, BS, 0.3)
    fixed_fwd = lambda *a: reference.msa_forward(*a[:8])  # noqa: E731 - drops cu_seqlens=None
    got = packed.per_sequence("msa_forward", fixed_fwd, None)(*x, sel, BS, 0.3, cu)
    want = reference.msa_forward_varlen(*x, sel, cu_seqlens=cu, block_size=BS, scale=0.3)
    for name, a, b in zip(("out", "lse", "lse_proxy", "kl_rows"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    dout = torch.randn(1, total, H, D, generator=g, dtype=torch.float64)
    kl_grad = torch.rand(1, Hp, total, generator=g, dtype=torch.float64)
    fixed_bwd = lambda *a: reference.msa_backward(*a[:13])  # noqa: E731
    got = packed.per_sequence("msa_backward", fixed_bwd, None)(*x, *want[:3], sel, BS, 0.3, dout, kl_grad, cu)
    want = reference.msa_backward_varlen(*x, *want[:3], sel, BS, 0.3, grad_out=dout, cu_seqlens=cu, kl_grad=kl_grad)
    for name, a, b in zip(("dq_proxy", "dk_proxy", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_padded_buckets_compute_the_varlen_contract_for_every_sparse_op(precision):
    """Selection (bf16 and fp8: padding zeros change no key block's scale), the KL pass alone and block-sparse
    attention forward and backward through packed.per_sequence around the fixed-length reference, on a pack whose
    sequences of different lengths share padded calls, against the varlen reference (float64, CPU)."""
    from flash_msa_rt.ops import packed
    from flash_msa_rt.ops.backends import reference_impl

    g = torch.Generator().manual_seed(5)
    lengths = [130, 200, 1, 0, 57, 64, 250, 130]  # 130, 200 and 250 pad to 256; 1, 57 and 64 to 128
    total, Hp, H, D, BS = sum(lengths), 2, 4, 8, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    assert all(b.members for b in packed.batches(packed.sequence_spans(cu), paddable=True))
    x = [torch.randn(1, total, h, D, generator=g, dtype=torch.float64) for h in (Hp, 1, H, 2, 2)]

    def both(op, *args):
        ref = reference_impl(op)
        return packed.per_sequence(op, ref, None)(*args, cu), ref(*args, cu)

    kw = {"precision": precision} if precision != "bf16" else {}
    sel = reference_impl("select_blocks")(x[0], x[1], 3, BS, 0.3, cu, **kw)
    got = packed.per_sequence("select_blocks", reference_impl("select_blocks"), None)(x[0], x[1], 3, BS, 0.3, cu, **kw)
    assert torch.equal(got, sel)
    lse = reference_impl("msa_forward")(*x, sel, BS, 0.3, cu)[1]
    for a, b in zip(*both("msa_kl", *x, lse, sel, BS, 0.3)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    idx = sel.repeat_interleave(H // Hp, dim=1)
    (out, lse_b), want = both("block_sparse_forward", *x[2:], idx, BS, 0.3)
    torch.testing.assert_close(out, want[0], rtol=1e-12, atol=1e-12)
    dout = torch.randn(1, total, H, D, generator=g, dtype=torch.float64)
    for a, b in zip(*both("block_sparse_backward", *x[2:], out, lse_b, idx, BS, 0.3, dout)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _captured(monkeypatch):
    """What the packed ops see under CUDA graph capture, on the CPU: no host read of the offsets allowed."""
    from flash_msa_rt.ops import offsets, packed

    monkeypatch.setattr(packed, "capturing", lambda cu: True)
    monkeypatch.setattr(offsets, "capturing", lambda cu: True)
    monkeypatch.setattr(offsets, "_read", lambda cu: pytest.fail("offsets read on the host under capture"))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_captured_packs_plan_on_the_device_and_compute_the_varlen_contract(monkeypatch, precision):
    """Under capture every op pads each sequence to the declared max_seqlen (rounded to 128) on the device, with no
    host read of cu_seqlens: selection (bf16, fp8), MSA forward, the KL pass, backward, warmup (lse padded with
    +inf) and block-sparse attention equal the varlen reference (float64, CPU), empty and one-token sequences and
    partial blocks included."""
    from flash_msa_rt import reference
    from flash_msa_rt.ops import offsets, packed
    from flash_msa_rt.ops.backends import reference_impl

    g = torch.Generator().manual_seed(11)
    lengths = [130, 0, 1, 57, 250, 128]
    total, Hp, H, D, BS = sum(lengths), 2, 4, 8, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = [torch.randn(1, total, h, D, generator=g, dtype=torch.float64) for h in (Hp, 1, H, 2, 2)]
    kw = {"precision": precision} if precision != "bf16" else {}
    sel = reference_impl("select_blocks")(x[0], x[1], 3, BS, 0.3, cu, **kw)
    fwd = reference.msa_forward_varlen(*x, sel, cu_seqlens=cu, block_size=BS, scale=0.3)
    big = [t * 40 for t in x]  # warmup at scores where exp(s) overflows: a padded lse must not be 0
    wfwd = reference_impl("warmup_forward")(*big, 0.3, cu)
    dout = torch.randn(1, total, H, D, generator=g, dtype=torch.float64)
    kl_grad = torch.rand(1, Hp, total, generator=g, dtype=torch.float64)
    cases = {"select_blocks": (x[0], x[1], 3, BS, 0.3), "msa_forward": (*x, sel, BS, 0.3),
             "msa_kl": (*x, fwd[1], sel, BS, 0.3),
             "msa_backward": (*x, *fwd[:3], sel, BS, 0.3, dout, kl_grad), "warmup_forward": (*big, 0.3),
             "warmup_kl": (*big, wfwd[1], 0.3), "warmup_backward": (*big, *wfwd[:3], 0.3, dout, kl_grad),
             "block_sparse_forward": (*x[2:], sel.repeat_interleave(H // Hp, dim=1), BS, 0.3)}
    want = {op: reference_impl(op)(*args, cu, **(kw if op == "select_blocks" else {})) for op, args in cases.items()}
    offsets.declare_max_seqlen(cu, 250)
    _captured(monkeypatch)
    for op, args in cases.items():
        got = packed.per_sequence(op, reference_impl(op), None)(*args, cu, **(kw if op == "select_blocks" else {}))
        for a, b in zip(*(((r,) if isinstance(r, torch.Tensor) else r) for r in (got, want[op]))):
            assert a.shape == b.shape, op
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, equal_nan=True, msg=op)  # scores ~ 1e3


def test_captured_packs_need_a_declared_bound(monkeypatch):
    from flash_msa_rt.ops import packed
    from flash_msa_rt.ops.backends import reference_impl

    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    x = torch.randn(1, 10, 2, 8)
    _captured(monkeypatch)
    with pytest.raises(RuntimeError, match="max_seqlen"):
        packed.per_sequence("select_blocks", reference_impl("select_blocks"), None)(x, x[:, :, :1], 1, 64, 0.3, cu)


def test_offsets_are_checked_on_the_device():
    """The device twin of validation.check_cu_seqlens_values and check_max_seqlen: each broken rule flags."""
    from flash_msa_rt.ops.offsets import invalid_on_device

    t = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    assert not invalid_on_device(t(0, 3, 3, 10), 10, 7)
    assert invalid_on_device(t(0, 3, 10), 10, 6)  # a sequence longer than max_seqlen
    assert invalid_on_device(t(1, 3, 10), 10, 9) and invalid_on_device(t(0, 3, 9), 10, 9)  # start, end
    assert invalid_on_device(t(0, 5, 3, 10), 10, 9)  # decreasing
    assert not invalid_on_device(t(0, 2, 5, 10), 10, 5, row_len=5)
    assert invalid_on_device(t(0, 2, 6, 10), 10, 5, row_len=5)  # a batch-row boundary missing


def test_captured_varlen_call_makes_bad_offsets_nan_instead_of_reading_them(monkeypatch):
    """flash_msa_varlen_func under capture: no host validation; offsets the host check would refuse (a sequence
    longer than max_seqlen) make out and kl_loss NaN, and valid ones give the eager call's values."""
    import flash_msa_rt as F
    from flash_msa_rt.ops import offsets

    g = torch.Generator().manual_seed(2)
    total = 300
    x = [torch.randn(total, h, 8, generator=g, dtype=torch.float64) for h in (2, 1, 4, 2, 2)]
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    want = F.flash_msa_varlen_func(*x, cu, 200, 128, block_size=64)
    monkeypatch.setattr(offsets, "capturing", lambda c: True)
    got = F.flash_msa_varlen_func(*x, cu, 200, 128, block_size=64)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    out, kl = F.flash_msa_varlen_func(*x, cu, 150, 128, block_size=64)  # 200 > max_seqlen: raises when eager
    assert out.isnan().all() and kl.isnan()
    with pytest.raises(NotImplementedError, match="cu_seqlens_k"):
        F.flash_msa_varlen_func(*x, cu, 200, 128, block_size=64, cu_seqlens_k=cu, max_seqlen_k=200)


def test_proxy_head_dim_64_below_d_is_accepted_on_the_default_build(catalogue_artifacts):
    """Dp 64 with D 128: selection (bf16, fp16, fp8) has its own Dp 64 variants in the default sm90a build, and
    the forward, backward (deterministic or not), KL pass and warmup run on the D kernels (the proxy padded to D);
    a Dp the kernels do not take that way is declined naming it and what is supported."""
    catalogue_artifacts("sm90a")
    for dtype in (torch.bfloat16, torch.float16):
        for precision in ("bf16", "fp8"):
            select = _problem("select_blocks", dtype, proxy_head_dim=64, top_k_blocks=16, select_precision=precision)
            assert kernels._select_supports(select) is None, (dtype, precision)
        for op, det in (("msa_forward", False), ("msa_backward", False), ("msa_backward", True)):
            assert kernels._msa_supports(_problem(op, dtype, proxy_head_dim=64, deterministic=det)) is None, op
        assert kernels._SUPPORTS["msa_kl"](_problem("msa_kl", dtype, proxy_head_dim=64)) is None
        for op in ("warmup_forward", "warmup_backward"):
            assert kernels._warmup_supports(_problem(op, dtype, proxy_head_dim=64, deterministic=False)) is None
    for dp in (32, 96, 256):
        reason = kernels._msa_supports(_problem(proxy_head_dim=dp))
        assert reason is not None and f"Dp {dp}" in reason and "Dp in (64, 128) below D" in reason, reason
    reason = kernels._select_supports(_problem("select_blocks", proxy_head_dim=32, top_k_blocks=16))
    assert "proxy head dim 32" in reason and "(64, 128)" in reason, reason


def test_sm100a_selects_at_dp64_on_mma_sync(catalogue_artifacts):
    """sm100a's default build has the mma.sync selection at Dp 64 too (fp8 selection is wgmma only: declined)."""
    catalogue_artifacts("sm100a")
    assert kernels._select_supports(_problem("select_blocks", proxy_head_dim=64, top_k_blocks=16)) is None
    assert kernels._select_supports(_problem("select_blocks", proxy_head_dim=64, top_k_blocks=16,
                                             select_precision="fp8")) is not None


def _reference_at_received_width(monkeypatch, D: int):
    """The GPU launchers the kernel backend calls, replaced by the reference on whatever proxy they receive, which
    must be D wide (the sparse and warmup proxy kernels are built for Dp = D)."""
    from flash_msa_rt.ops.backends import reference_impl

    def at_d(op):
        def run(q_proxy, k_proxy, *args, **kwargs):
            assert q_proxy.shape[-1] == k_proxy.shape[-1] == D, (op, q_proxy.shape, k_proxy.shape)
            kwargs.pop("deterministic", None)
            kwargs.pop("kl_rows", None)  # the reference forms no KL rows in its backward: the list stays empty
            kwargs.pop("keep_lists", None)  # the plan's sorted lists, which the reference does not make
            return reference_impl(op)(q_proxy, k_proxy, *args, **kwargs)
        return run

    monkeypatch.setattr(kernels.sparse_fwd, "msa_forward_cuda", at_d("msa_forward"))
    # the KL pass takes no v; the reference's takes one and ignores its values (k stands in); it forms both outputs
    # whatever with_kl
    monkeypatch.setattr(kernels.sparse_fwd, "msa_kl_cuda",
                        lambda qp, kp, q, k, lse, sel, bs, scale, with_kl=True, proxy_scale=None:
                        at_d("msa_kl")(qp, kp, q, k, k, lse, sel, bs, scale, proxy_scale=proxy_scale))
    monkeypatch.setattr(kernels.sparse_bwd, "msa_backward_cuda", at_d("msa_backward"))


def test_proxy_below_d_is_padded_exactly(monkeypatch):
    """Dp 64 < D 128 on the kernel backend: the KL pass and the backward receive the proxy zero-padded to D, and
    lse_proxy, kl_rows and the proxy gradients (cut back to Dp) equal the reference's at Dp, as do the main
    outputs: the zero columns add exact zeros to every proxy score and never reach the first Dp columns of a
    gradient. The GPU launchers are replaced by the float64 reference at the width they receive; odd S, GQA,
    Hp < H, Hpk = 1; warmup included (its sparse main path on this CPU)."""
    from flash_msa_rt.ops.backends import reference_impl

    _reference_at_received_width(monkeypatch, 128)
    g = torch.Generator().manual_seed(7)
    B, S, H, Hk, Hp, Hpk, D, Dp, bs = 1, 301, 8, 2, 2, 1, 128, 64, 128

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    qp, kp, q, k, v = rand(B, S, Hp, Dp), rand(B, S, Hpk, Dp), rand(B, S, H, D), rand(B, S, Hk, D), rand(B, S, Hk, D)
    scale = D ** -0.5
    sel = reference_impl("select_blocks")(qp, kp, 2, bs, scale)
    grad_out, kl_grad = rand(B, S, H, D), rand(B, Hp, S)

    def close(got, want):
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    fwd = kernels._msa_forward(qp, kp, q, k, v, sel, bs, scale)
    close(fwd, reference_impl("msa_forward")(qp, kp, q, k, v, sel, bs, scale))
    out, lse, lse_p = fwd[:3]
    close(kernels._msa_kl(qp, kp, q, k, v, lse, sel, bs, scale), fwd[2:])
    bwd = kernels._msa_backward(qp, kp, q, k, v, out, lse, lse_p, sel, bs, scale, grad_out, kl_grad)
    close(bwd, reference_impl("msa_backward")(qp, kp, q, k, v, out, lse, lse_p, sel, bs, scale, grad_out, kl_grad))
    # (B, S, heads, Dp) views of (B, heads, S, Dp) proxies (the public API's default layout): the cut gradients
    # come in those views' layout, as the kernels write every other gradient (autograd then copies none)
    qp_v, kp_v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (qp, kp))
    bwd_v = kernels._msa_backward(qp_v, kp_v, q, k, v, out, lse, lse_p, sel, bs, scale, grad_out, kl_grad)
    close(bwd_v, bwd)
    assert [g_.stride() for g_ in bwd_v[:2]] == [torch.empty_like(t).stride() for t in (qp_v, kp_v)]
    assert not bwd_v[0].is_contiguous()  # Hp = 2: the view is not (Hpk = 1's is)

    # warmup's main attention on the sparse path (a CUDA build of torch would otherwise offer cuDNN here)
    monkeypatch.setattr(kernels.dense_main, "available", lambda: "not in this test")
    assert not kernels._dense_main(q)
    wfwd = kernels._warmup_forward(qp, kp, q, k, v, scale)
    close(wfwd, reference_impl("warmup_forward")(qp, kp, q, k, v, scale))
    wout, wlse, wlse_p = wfwd[:3]
    close(kernels._warmup_kl(qp, kp, q, k, v, wlse, scale), wfwd[2:])
    close(kernels._warmup_backward(qp, kp, q, k, v, wout, wlse, wlse_p, scale, grad_out, kl_grad),
          reference_impl("warmup_backward")(qp, kp, q, k, v, wout, wlse, wlse_p, scale, grad_out, kl_grad))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_key_results_sum_in_part_order_over_overlaps_only(dtype):
    """packed._summed_key_results: keys covered by one call are that call's values, keys covered by several the
    fp32 (fp64) sum in call order cast once, uncovered keys 0: the values of one fp32 accumulator over every key,
    without it. Ranges as one context-parallel rank's (a shared prefix), a gap, and a range inside another."""
    from flash_msa_rt.ops import packed

    g = torch.Generator().manual_seed(4)
    ranges = [(0, 300), (0, 90), (350, 40), (360, 10)]
    total = 420
    for dim in (1, 2):
        parts = []
        for _, n in ranges:
            shape = [1, n, 3] if dim == 1 else [1, 3, n]
            parts.append((torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype))
        shape = [1, total, 3] if dim == 1 else [1, 3, total]
        acc = torch.zeros(shape, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        for p, (ks, n) in zip(parts, ranges):
            acc.narrow(dim, ks, n).add_(p)
        got = packed._summed_key_results(parts, ranges, dim, total)
        assert got.dtype == dtype and torch.equal(got, acc.to(dtype)), dim
        assert (got.narrow(dim, 300, 50) == 0).all()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_separate_key_offsets_on_the_fixed_length_ops_compute_the_varlen_contract(precision):
    """Queries that are the last L_q of their sequence's L_k keys (cu_seqlens_k), key ranges shared by two query
    sequences (seqused_k, one context-parallel rank's two zigzag chunks), L_q = 0, L_q not a multiple of the block:
    packed.per_sequence runs each query sequence against a view of its keys on the fixed-length reference ops
    (unpadded for the ops that take longer keys themselves: selection and the sparse MSA ops; front-padded to L_k
    for warmup), and every op equals the varlen reference (float64, CPU); key gradients of shared keys sum."""
    from flash_msa_rt.ops import packed
    from flash_msa_rt.ops.backends import reference_impl

    g = torch.Generator().manual_seed(7)
    Hp, H, D, BS = 2, 4, 8, 64
    q_lens, k_starts, used = [50, 0, 37, 130], [0, 0, 300, 300], [150, 150, 300, 290]  # key ranges overlap
    total_q, total_k = sum(q_lens), 600
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k, used_k = torch.tensor(k_starts + [total_k], dtype=torch.int32), torch.tensor(used, dtype=torch.int32)
    keys = {"cu_seqlens_k": cu_k, "seqused_k": used_k}
    x = [torch.randn(1, n, h, D, generator=g, dtype=torch.float64)
         for n, h in ((total_q, Hp), (total_k, 1), (total_q, H), (total_k, 2), (total_k, 2))]
    kw = {"precision": precision} if precision != "bf16" else {}
    sel = reference_impl("select_blocks")(x[0], x[1], 3, BS, 0.3, cu, **kw, **keys)
    fwd = reference_impl("msa_forward")(*x, sel, BS, 0.3, cu, **keys)
    wfwd = reference_impl("warmup_forward")(*x, 0.3, cu, **keys)
    dout = torch.randn(1, total_q, H, D, generator=g, dtype=torch.float64)
    kl_grad = torch.rand(1, Hp, total_q, generator=g, dtype=torch.float64)
    cases = {"select_blocks": ((x[0], x[1], 3, BS, 0.3), kw), "msa_forward": ((*x, sel, BS, 0.3), {}),
             "msa_kl": ((*x, fwd[1], sel, BS, 0.3), {}),
             "msa_backward": ((*x, *fwd[:3], sel, BS, 0.3, dout, kl_grad), {}), "warmup_forward": ((*x, 0.3), {}),
             "warmup_kl": ((*x, wfwd[1], 0.3), {}), "warmup_backward": ((*x, *wfwd[:3], 0.3, dout, kl_grad), {})}
    for op, (args, extra) in cases.items():
        ref = reference_impl(op)
        fixed = lambda *a, ref=ref, **k: ref(*a, **k)  # noqa: E731 - sees cu_seqlens=None only
        got = packed.per_sequence(op, fixed, ref)(*args, cu, **extra, **keys)
        want = ref(*args, cu, **extra, **keys)
        for a, b in zip(*(((r,) if isinstance(r, torch.Tensor) else r) for r in (got, want))):
            assert a.shape == b.shape, op
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, equal_nan=True, msg=op)



@pytest.mark.parametrize("bs", [64, 128])
def test_d256_runs_on_the_kernels_its_build_makes(bs, catalogue_artifacts):
    """After `build --arch sm90a --head-dim 256 --block-size Bs` every MSA op, the deterministic backward, warmup
    and block-sparse attention at D 256 resolve to the kernels (the main ones on 64-key blocks); the default build
    declines D 256 naming that command."""
    from flash_msa_rt.ops.backends import Problem

    def verdicts():
        out = {}
        for op, extra in (("msa_forward", {}), ("msa_backward", {"deterministic": False}),
                          ("msa_backward", {"deterministic": True}), ("warmup_forward", {}),
                          ("warmup_backward", {"deterministic": False})):
            config = dict(head_dim=256, proxy_head_dim=128, block_size=bs, group=4, kv_group=4, varlen=False, **extra)
            out[(op, extra.get("deterministic"))] = kernels._supports(
                Problem(op, torch.device("cuda", 0), torch.bfloat16, config))
        for op in ("block_sparse_forward", "block_sparse_backward"):
            config = dict(head_dim=256, block_size=bs, heads=16, index_heads=2, kv_group=8, varlen=False,
                          deterministic=False)
            out[(op, None)] = kernels._supports(Problem(op, torch.device("cuda", 0), torch.bfloat16, config))
        return out

    catalogue_artifacts("sm90a", head_dims=(256,), block_sizes=(bs,))
    assert all(v is None for v in verdicts().values()), verdicts()
    catalogue_artifacts("sm90a")  # the default build: D 64 and 128
    reason = verdicts()[("msa_forward", None)]
    assert reason and f"--arch sm90a --dtype bf16 --head-dim 256 --block-size {bs}" in reason, reason
    catalogue_artifacts("sm100a")  # the default build on mma.sync: D 256 is built on request there too
    reason = verdicts()[("msa_forward", None)]
    assert reason and f"--arch sm100a --dtype bf16 --head-dim 256 --block-size {bs}" in reason, reason
    catalogue_artifacts("sm100a", head_dims=(256,), block_sizes=(bs,))  # then everything but the deterministic
    got = verdicts()  # backward (its kernels are the wgmma tau path's, sm90a only) runs on the mma.sync kernels
    assert all(v is None for k, v in got.items() if k != ("msa_backward", True)), got
    assert got[("msa_backward", True)], got
