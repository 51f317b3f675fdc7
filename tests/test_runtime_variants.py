"""The variants the runtime launches are the ones the build catalogue makes, on every arch and G, and the buffers
the runtime sizes by its own rules match the kernels' declared ABI. The runtime may not import kernels_src, so
these rules live on both sides; a drift between them would otherwise show only on a GPU (a missing variant, or a
buffer the loader refuses)."""

import pytest

from kernels_src import matrix

from flash_msa_rt import tuning
from flash_msa_rt.manifest import variant_name
from flash_msa_rt.ops import block_scores as rt_scores
from flash_msa_rt.ops import select as rt_select
from flash_msa_rt.ops import sparse_bwd as rt_bwd
from flash_msa_rt.ops import sparse_fwd as rt_fwd
from flash_msa_rt.ops import warmup_kl as rt_warmup_kl
from kernels_src import sparse_bwd, sparse_kl, warmup_kl
from kernels_src.catalogue import variants

DTYPES = ("bf16", "f16")
GROUPS = (1, 2, 4, 8, 16)


def _names(launched, arch):
    return [variant_name(op, cfg, arch) for op, cfg in launched]


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_every_launched_variant_is_in_the_catalogue(arch):
    """What the runtime launches by default on arch (the tuning policies' choices) is in arch's default build."""
    built = {s.name for s in variants((arch,))}
    launched = [("select", rt_select.kernel_config(dt, dp, 128, k, tuning.select.choose(arch).mma))
                for dt in DTYPES for dp in (64, 128) for k in (16, 64)]
    if arch == "sm90a":  # fp8 selection (wgmma only) at both proxy head dims
        launched += [("select", rt_select.kernel_config("e4m3", dp, 128, k, rt_select.mma_for(arch, "fp8")))
                     for dp in (64, 128) for k in (16, 64)]
    launched += [("block_scores", rt_scores.kernel_config("bf16", dp, 128, tuning.block_scores.choose(arch).mma))
                 for dp in (64, 128)]
    for dt in DTYPES:
        for G in GROUPS:
            launched += rt_fwd.variants(dt, 128, 128, 128, G, arch) + rt_bwd.variants(dt, 128, 128, 128, G, arch)
    missing = [n for n in _names(launched, arch) if n not in built]
    assert not missing, missing


@pytest.mark.parametrize("overrides", [
    tuning.every_mma("sync"),
    {"sparse_fwd": {"schedule": "lockstep", "kl_schedule": "lockstep"}},
    {"sparse_fwd": {"stages": 2}},
    {"sparse_fwd": {"combine_heads": 1}},
    {"sparse_bwd": {"tau_path": False, "recompute_heads": "stepped"}},
    {"sparse_bwd": {"producer": False}},
], ids=["sync", "lockstep", "two-q-buffers", "one-head-combine", "stepped", "no-producer"])
def test_variants_the_gpu_tests_force_are_built_for_sm90a(overrides):
    """The alternate variants the GPU tests and sanitizers reach through tuning.override are all in the sm90a
    catalogue (the opt-in build set, or the hopper_sync_check set for mma.sync; the forward's one q buffer is not
    built at G = 1, and the proxy backward's resident heads stop at G = 4: the tests ask for those only where they
    exist)."""
    built = {s.name for s in variants(("sm90a",), sets="all")}
    launched = []
    with tuning.override(**overrides):
        for dt in DTYPES:
            for G in GROUPS:
                launched += rt_fwd.variants(dt, 128, 128, 128, G, "sm90a")
                launched += rt_bwd.variants(dt, 128, 128, 128, G, "sm90a")
    missing = [n for n in _names(launched, "sm90a") if n not in built]
    assert not missing, missing


def test_overrides_are_scoped_and_checked():
    """An override holds inside its block only, nests (inner fields win), and names a policy and fields that
    exist."""
    assert rt_fwd.choice("sm90a", 4).schedule == "pingpong"
    with tuning.override(sparse_fwd={"schedule": "lockstep"}):
        assert rt_fwd.choice("sm90a", 4).schedule == "lockstep"
        assert rt_fwd.choice("sm90a", 4).stages == 2  # derived from the overridden schedule
        with tuning.override(sparse_fwd={"schedule": "pingpong"}, sparse_bwd={"producer": False}):
            assert rt_fwd.choice("sm90a", 4).schedule == "pingpong" and not rt_bwd.choice("sm90a", 4).producer
        assert rt_bwd.choice("sm90a", 4).producer
    assert rt_fwd.choice("sm90a", 4).schedule == "pingpong" and tuning.current() == tuning.NONE
    with tuning.override(**tuning.every_mma("sync")):
        fwd = rt_fwd.choice("sm90a", 4)
        assert (fwd.mma, fwd.schedule, fwd.kl_schedule, fwd.kl_tile_n) == ("sync", "lockstep", "lockstep", 64)
    with pytest.raises(ValueError, match="unknown policy 'sparse_fw'"):
        with tuning.override(sparse_fw={"stages": 1}):
            pass
    with pytest.raises(ValueError, match=r"sparse_fwd has no fields \['stage'\]"):
        with tuning.override(sparse_fwd={"stage": 1}):
            pass


def test_dense_warmup_variants_are_the_catalogues():
    """The runtime's dense warmup KL pass (in either schedule), proxy lse alone and proxy backward (with and without
    the KL value) launch a built variant for each group they claim (sm90a), and claim exactly the groups the
    catalogue builds (a group not claimed would silently
    keep the slow sparse kernels)."""
    t = tuning.warmup.choose("sm90a")
    dims = matrix.DEFAULT_HEAD_DIMS  # the default build's head dims
    launches = {"warmup_kl": [rt_warmup_kl.kernel_config(dt, d, G, sc) for dt in DTYPES for d in dims
                              for G in warmup_kl.GROUPS
                              for sc in tuning.warmup.KL_SCHEDULE_THREADS]  # the policy's schedule, or a test's
                + [rt_warmup_kl.lse_config(dt, d) for dt in DTYPES for d in dims],  # deferred mode's proxy lse alone
                "warmup_bwd_proxy": [rt_warmup_kl.backward_config(dt, d, rt_warmup_kl.backward_chunk(G, t), kv)
                                     for dt in DTYPES for d in dims for G in GROUPS for kv in (0, 1)
                                     if not kv or rt_warmup_kl.backward_chunk(G, t) == G]}  # the KL value: G <= 4
    for op, configs in launches.items():
        built = {s.name for s in variants(("sm90a",), sets="all") if s.op == op}  # lockstep: opt-in
        assert {variant_name(op, c, "sm90a") for c in configs} == built, op
        assert not [s for s in variants(("sm100a",)) if s.op == op]
    assert all(G % rt_warmup_kl.backward_chunk(G, t) == 0 for G in GROUPS)


@pytest.mark.parametrize("mma, schedule, groups", [("sync", None, 4), ("wgmma", "lockstep", 2),
                                                    ("wgmma", "pingpong", 1), ("wgmma", None, 1)])
def test_kl_part_columns_are_the_kernels(mma, schedule, groups):
    """The KL pass writes (A, T, L) per key group: 64-key slices x 2 halves on mma.sync, the whole block x 2
    warpgroups on wgmma in lockstep, one group in ping-pong (the runtime's default at G = 4). The runtime allocates
    kl_part from kl_part_groups; the kernel declares its columns; the build has the variant."""
    over = {"kl_mma": mma, **({"kl_schedule": schedule} if schedule else {})}
    with tuning.override(sparse_fwd=over):
        cfg = rt_fwd.kl_config("bf16", 128, 128, 4, rt_fwd.choice("sm90a", 4))
    config = sparse_kl.Config(**cfg)
    assert sparse_kl.can_implement(config, "sm90a")[0], config
    kl_part = next(p for p in sparse_kl.params(config) if p.name == "kl_part")
    assert kl_part.shape[1] == 3 * rt_fwd.kl_part_groups(cfg) == 3 * groups
    assert config in sparse_kl.configs()


def test_proxy_heads_the_runtime_launches_are_built():
    """The proxy backward recomputing tau: resident heads on wgmma at G <= 4, stepped otherwise (and when forced);
    reading tau from the main backward on wgmma at every G (one variant, group 1), beside a main backward variant
    that writes it; all built."""
    from kernels_src import sparse_bwd_proxy

    for G in (1, 2, 4, 8, 16):
        for mma in ("sync", "wgmma"):
            for heads in (None, "stepped"):
                with tuning.override(sparse_bwd={"mma": mma, "proxy_mma": mma,
                                                 **({"recompute_heads": heads} if heads else {})}):
                    t = rt_bwd.choice("sm90a", G)
                cfg = rt_bwd.proxy_config("bf16", 128, 128, G, t)
                assert cfg["heads"] == ("resident" if mma == "wgmma" and G <= 4 and heads is None else "stepped")
                assert sparse_bwd_proxy.Config(**cfg) in sparse_bwd_proxy.configs()
                assert t.tau_path == (mma == "wgmma")
                if t.tau_path:
                    cfg = rt_bwd.proxy_config("bf16", 128, 128, G, t, tau=True)
                    assert cfg["heads"] == "tau" and cfg["group"] == 1
                    assert sparse_bwd_proxy.Config(**cfg) in sparse_bwd_proxy.configs()
        main = rt_bwd.kernel_config("bf16", 128, 128, G, rt_bwd.choice("sm90a", G), tau_out=True)
        assert sparse_bwd.MainConfig(**main) in sparse_bwd.configs()
        assert sparse_bwd.can_implement(sparse_bwd.MainConfig(**main), "sm90a")[0]
    ok, reason = sparse_bwd.can_implement(sparse_bwd.MainConfig(tau_out=1), "sm90a")  # mma.sync: 64-key slices
    assert not ok and "tau_out 1" in reason
    ok, reason = sparse_bwd_proxy.can_implement(sparse_bwd_proxy.Config(group=4, tile_n=128, mma="wgmma",
                                                                        heads="tau"), "sm90a")
    assert not ok and "group 1" in reason
    ok, reason = sparse_bwd_proxy.can_implement(sparse_bwd_proxy.Config(group=8, tile_n=128, mma="wgmma",
                                                                        heads="resident"), "sm90a")
    assert not ok and "resident" in reason and "G 8" in reason


def test_deterministic_backward_variants_are_built():
    """Under deterministic algorithms sm90a runs the tau path's deterministic variants (every G, both dtypes);
    sm100a has none (mma.sync) and says so; deterministic is refused off the tau path's configurations."""
    from kernels_src import slot_sum, sparse_bwd_proxy

    for dt in ("bf16", "f16"):
        for G in (1, 2, 4, 8, 16):
            launched = rt_bwd.variants(dt, 128, 128, 128, G, "sm90a", deterministic=True)
            assert [op for op, _ in launched] == ["sparse_bwd", "sparse_bwd_proxy", "bwd_delta", "slot_sum",
                                                  "slot_sum"] + ["plan_lists"] * 4 + ["plan_items"]
            main, proxy = launched[0][1], launched[1][1]
            assert main["deterministic"] == proxy["deterministic"] == 1 and main["tau_out"] == 1
            assert sparse_bwd.MainConfig(**main) in sparse_bwd.configs()
            assert sparse_bwd_proxy.Config(**proxy) in sparse_bwd_proxy.configs()
            for (_, cfg), group in zip(launched[3:5], (G, 1)):  # dq over G heads, dq_p over one
                assert cfg["group"] == group and slot_sum.Config(**cfg) in slot_sum.configs()
    assert rt_bwd.deterministic_refusal("sm90a") is None
    assert "sm100a" in rt_bwd.deterministic_refusal("sm100a")
    ok, reason = sparse_bwd.can_implement(sparse_bwd.MainConfig(tile_n=128, mma="wgmma", deterministic=1), "sm90a")
    assert not ok and "tau_out 1" in reason
    ok, reason = sparse_bwd_proxy.can_implement(sparse_bwd_proxy.Config(group=4, tile_n=128, mma="wgmma",
                                                                        heads="resident", deterministic=1), "sm90a")
    assert not ok and "deterministic" in reason


def test_deterministic_budget_and_entry_bytes():
    """Deterministic chunks hold tau plus fp32 dq / dq_p rows per entry, within twice the dq
    accumulator bounded by [2, 4] GiB (tuning.sparse_bwd)."""
    def budget(B, S, H, D):
        return rt_bwd.choice("sm90a", 4, D, 128, B, S, H).deterministic_budget

    assert rt_bwd.entry_bytes(128, 4, 128) == 256
    assert rt_bwd.entry_bytes(128, 4, 128, True) == 256 + 4 * 4 * 128 + 4 * 128
    assert budget(1, 8192, 16, 128) == 2 << 30
    assert budget(1, 65536, 16, 128) == 2 << 30
    assert budget(3, 65536, 16, 128) == 8 * 3 * 65536 * 16 * 128
    assert budget(2, 65536, 32, 128) == 4 << 30
    per_entry = rt_bwd.entry_bytes(128, 4, 128, True)
    c = rt_bwd.tau_heads(2, 65536, 8, 8, 1, 16, 128, 4 << 30, per_entry)
    chunk = rt_bwd.tau_chunk(2, 65536, c, 16, 128, 4 << 30, per_entry)
    assert c == 1 and 2 * c * chunk * 16 * per_entry <= (4 << 30) * 1.125


def test_kl_schedules_the_runtime_launches_are_built():
    """wgmma runs the KL pass in ping-pong (resident heads single-buffered at G <= 4, a ring of slots at G = 8, 16),
    mma.sync in lockstep; forcing lockstep on wgmma gives the lockstep kernel, built for every G. A ring of one
    slot, or resident heads with two, is refused."""
    assert rt_fwd.choice("sm90a", 4).kl_schedule == "pingpong" and rt_fwd.choice("sm100a", 4).kl_schedule == "lockstep"
    for G in (1, 2, 4, 8, 16):
        for schedule in (None, "lockstep"):
            with tuning.override(sparse_fwd={"kl_schedule": schedule} if schedule else {}):
                config = sparse_kl.Config(**rt_fwd.kl_config("bf16", 128, 128, G, rt_fwd.choice("sm90a", G)))
            assert config in sparse_kl.configs(), config
    assert rt_fwd.kl_config("bf16", 128, 128, 16, rt_fwd.choice("sm90a", 16))["stages"] == sparse_kl.STREAM_STAGES
    for G, stages in ((8, 1), (4, 2)):
        ok, reason = sparse_kl.can_implement(sparse_kl.Config(group=G, tile_n=128, mma="wgmma", stages=stages,
                                                              schedule="pingpong"), "sm90a")
        assert not ok and "pingpong" in reason and f"G {G}" in reason


@pytest.mark.parametrize("mma", ["sync", "wgmma"])
def test_backward_keys_per_cta_agree(mma):
    with tuning.override(sparse_bwd={"mma": mma}):
        assert rt_bwd.kernel_config("bf16", 128, 128, 4, rt_bwd.choice("sm90a", 4))["tile_n"] == \
            sparse_bwd.tile_n_for(mma, 128)


def test_kl_pass_runs_wgmma_on_hopper_at_every_group():
    """On sm90a the KL pass runs wgmma in ping-pong at every G (heads resident at G <= 4, streamed at 8, 16), and
    mma.sync elsewhere."""
    assert rt_fwd.choice("sm90a", 4).kl_mma == "wgmma" and rt_fwd.choice("sm100a", 4).kl_mma == "sync"
    for G in (1, 2, 4, 8, 16):
        config = sparse_kl.Config(**rt_fwd.kl_config("bf16", 128, 128, G, rt_fwd.choice("sm90a", G)))
        assert config.schedule == "pingpong" and sparse_kl.resident_heads(config) == (G <= 4)


@pytest.mark.parametrize("Hp,Hk,Hpk", [(8, 8, 1), (8, 2, 2), (4, 4, 1), (6, 3, 2), (16, 1, 16), (12, 4, 3)])
def test_tau_head_chunks_map_every_head(Hp, Hk, Hpk):
    """The tau path's chunks of proxy heads (tau_heads, chunk_heads): whatever the budget, the chunk size divides
    Hp and, inside a chunk, local head p' // per lands on the global KV / proxy-key head of p0 + p'."""
    per_head = 2 * 4096 * 16 * 128 * 2  # B = 2, S = 4096, K = 16
    seen = set()
    for heads_in_budget in range(0, Hp + 2):
        c = rt_bwd.tau_heads(2, 4096, Hp, Hk, Hpk, 16, 128, budget=max(1, heads_in_budget * per_head))
        assert Hp % c == 0 and (c <= max(1, heads_in_budget))
        seen.add(c)
        for p0 in range(0, Hp, c):
            for ratio in (Hp // Hk, Hp // Hpk):
                heads, per = rt_bwd.chunk_heads(p0, c, ratio)
                for p in range(p0, p0 + c):
                    assert heads.start + (p - p0) // per == p // ratio < heads.stop
    assert 1 in seen and Hp in seen


def test_tau_budget_is_one_gib():
    """Half the fp32 dq accumulator within [1 GiB, 1 GiB] (tuning.sparse_bwd: fewer chunks won over a lower peak
    at B = 1): small problems in one chunk, large ones in chunks of at most 1 GiB of tau rows; an override sets
    it."""
    for shape in ((1, 8192, 16, 128), (1, 65536, 16, 128), (2, 65536, 32, 128), (1, 1 << 20, 64, 128)):
        B, S, H, D = shape
        assert rt_bwd.choice("sm90a", 4, D, 128, B, S, H).tau_budget == 1 << 30
    # (a) at B = 1, 64K: every proxy head in one chunk (4 x 268 MB of tau rows); (b) at 64K: two heads per chunk
    assert rt_bwd.tau_heads(1, 65536, 4, 2, 1, 16, 128, 1 << 30) == 4
    assert rt_bwd.tau_heads(2, 65536, 8, 8, 1, 16, 128, 1 << 30) == 2
    with tuning.override(sparse_bwd={"tau_budget": 1 << 28}):
        assert rt_bwd.choice("sm90a", 4, 128, 128, 1, 8192, 16).tau_budget == 1 << 28


def test_items_by_problem_size():
    """tuning.sparse_fwd / sparse_bwd (sweep_small, H100): up to 32K proxy rows B Hp S every kernel's items are a
    quarter of their usual size; up to 64K the forward's alone; beyond, and with no sizes (the variants'
    question), the usual ones. The backward's items run in query bins at D 256 at every size."""
    def fwd(B, S, H=16, G=4, D=128):
        return rt_fwd.choice("sm90a", G, D, 128, B, S, H)

    def bwd(B, S, H=16, G=4, D=128):
        return rt_bwd.choice("sm90a", G, D, 128, B, S, H)

    usual = (fwd(1, 65536).tiles_per_item, fwd(1, 65536).kl_tiles_per_item, bwd(1, 65536).tiles_per_item,
             bwd(1, 65536).proxy_tiles_per_item)
    assert usual == (64, 32, 64, 32)
    assert (fwd(0, 0).tiles_per_item, bwd(0, 0).tiles_per_item) == (64, 64)
    # (a) B = 1: 8K is 32K proxy rows, 16K is 64K
    assert (fwd(1, 8192).tiles_per_item, fwd(1, 8192).kl_tiles_per_item, bwd(1, 8192).tiles_per_item,
            bwd(1, 8192).proxy_tiles_per_item) == (16, 8, 16, 8)
    assert (fwd(1, 16384).tiles_per_item, fwd(1, 16384).kl_tiles_per_item, bwd(1, 16384).tiles_per_item,
            bwd(1, 16384).proxy_tiles_per_item) == (16, 32, 64, 32)
    assert fwd(2, 16384).tiles_per_item == 64
    # G = 1 keeps the entry table's bound (32 tiles) and takes a quarter of 64 at small steps
    assert (bwd(1, 65536, G=1).tiles_per_item, bwd(1, 2048, G=1).tiles_per_item) == (32, 16)
    assert bwd(1, 65536).item_order == "list" and bwd(1, 65536, D=256).item_order == "query"
    assert bwd(1, 8192, D=256).item_order == "query" and bwd(1, 8192, G=16).item_order == "query"
    # lists cut at query bins at key blocks of 64 below D 256 (sweep_bins.json)
    assert rt_bwd.choice("sm90a", 4, 128, 64, 1, 65536, 16).item_order == "bins"
    assert rt_bwd.choice("sm90a", 4, 256, 64, 1, 65536, 16).item_order == "query"
    with tuning.override(sparse_fwd={"tiles_per_item": 64}, sparse_bwd={"item_order": "list"}):
        assert fwd(1, 8192).tiles_per_item == 64 and bwd(1, 8192, D=256).item_order == "list"


@pytest.mark.parametrize("producer", [False, True])
def test_producer_variants_agree_with_the_build(producer):
    """With the producer on (the policy's choice), the runtime asks for the warp-specialised main backward
    exactly where the build makes it (and every variant it launches is built); overridden off, never."""
    from flash_msa_rt.ops import sparse_bwd as runtime
    from kernels_src import sparse_bwd as build

    assert (runtime.PRODUCER_THREADS, runtime.PRODUCER_GROUPS) == (build.PRODUCER_THREADS, build.PRODUCER_GROUPS)
    built = {s.name for s in variants(("sm90a",), sets="all", only=["sparse_bwd_*"])}  # no producer: opt-in
    with tuning.override(sparse_bwd={} if producer else {"producer": False}):
        for G in build.GROUPS:
            t = runtime.choice("sm90a", G)
            want = producer and G in build.PRODUCER_GROUPS
            config = runtime.kernel_config("bf16", 128, 128, G, t, tau_out=True)
            assert (config["threads"] == build.PRODUCER_THREADS) == want, G
            assert variant_name("sparse_bwd", config, "sm90a") in built, config
            assert runtime.kernel_config("bf16", 128, 128, G, t, True, True)["threads"] == 256
            assert runtime.kernel_config("bf16", 128, 128, G, t)["threads"] == 256


@pytest.mark.parametrize("d, bs", [(d, bs) for d in matrix.HEAD_DIMS for bs in matrix.BLOCK_SIZES])
def test_every_matrix_point_launches_what_its_one_command_builds(d, bs):
    """At each (D, Bs) of the contract, every variant a step launches on sm90a (selection at each Dp <= D, the
    forward, the backward atomic and deterministic, the block-sparse op, at every G) is in what
    `build --head-dim D --block-size Bs` compiles (default and hopper_sync_check sets). At D 256 the main kernels
    run on 64-key blocks (tuning.head_dim.kernel_block_size), so a selection of 128 launches those."""
    from flash_msa_rt.ops import block_sparse as rt_block_sparse
    from flash_msa_rt.tuning.head_dim import kernel_block_size

    built = {s.name for s in variants(("sm90a",), head_dims=(d,), block_sizes=(bs,))}
    kbs = kernel_block_size(d, bs)
    launched = []
    for dt in DTYPES:
        for dp in [p for p in matrix.PROXY_HEAD_DIMS if p <= d]:
            launched += [("select", rt_select.kernel_config(dt, dp, bs, k, tuning.select.choose("sm90a").mma))
                         for k in (16, 64)]
            for G in GROUPS:
                launched += rt_bwd.variants(dt, d, dp, kbs, G, "sm90a")
                launched += rt_bwd.variants(dt, d, dp, kbs, G, "sm90a", deterministic=True)
        for G in GROUPS:
            launched += rt_fwd.variants(dt, d, d, kbs, G, "sm90a")
            launched += rt_block_sparse.variants(dt, d, kbs, G, "sm90a", backward=True)
    missing = sorted(set(_names(launched, "sm90a")) - built)
    assert not missing, missing
    assert (kbs == 64) == (d == 256 and bs == 128) or kbs == bs == 64


def test_the_wide_selection_schedule_launches_catalogued_variants_at_blocks_of_64_only():
    """tuning.select's block64_schedule "wide" (opt-in build) reaches the select variants the catalogue makes with
    it at key blocks of 64, in every dtype including fp8; blocks of 128 keep their loop; the default is "block"."""
    built = {s.name for s in variants(("sm90a",), sets="all", block_sizes=(64, 128))}
    assert rt_select.schedule_for("sm90a", "bf16", 64) == "block"
    with tuning.override(select={"block64_schedule": "wide"}):
        assert [rt_select.schedule_for("sm90a", p, bs) for p in ("bf16", "fp8") for bs in (64, 128)] == \
            ["wide", "block", "wide", "block"]
        assert rt_select.schedule_for("sm100a", "bf16", 64) == "block"  # mma.sync: no wide form
        launched = [("select", rt_select.kernel_config(rt_select.variant_dtype(dt, p), dp, 64, k,
                                                       rt_select.mma_for("sm90a", p),
                                                       rt_select.schedule_for("sm90a", p, 64)))
                    for dt in DTYPES for p in ("bf16", "fp8") for dp in (64, 128) for k in (16, 64)]
    names = _names(launched, "sm90a")
    assert all("schedwide" in n for n in names) and not [n for n in names if n not in built]
