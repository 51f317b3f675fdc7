"""Build sets (kernels_src.spec): the default build is what the runtime's default paths launch plus, on sm90a, the
mma.sync variants of the sm100a paths (hopper_sync_check); the A/B alternates build only on request (opt_in).
Enumerating the catalogue needs no cutlass. That every launched variant is in the default build is checked
against the runtime's own choices in tests/test_runtime_variants.py."""

import pytest

from build_tools.__main__ import BUILD_SET_ENV, main
from kernels_src.catalogue import CatalogueError, parse_sets, variants
from kernels_src.spec import ARCHS, DEFAULT, DEFAULT_SETS, HOPPER_SYNC_CHECK, OPT_IN, SETS


def names(arch, sets):
    return {s.name for s in variants((arch,), sets=sets)}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_is_in_exactly_one_set(arch):
    every = variants((arch,), sets="all")
    assert {s.build_set for s in every} <= set(SETS)
    by_set = [names(arch, (n,)) for n in SETS]
    assert sum(len(s) for s in by_set) == len(every) == len(set().union(*by_set))
    assert names(arch, DEFAULT_SETS) == by_set[0] | by_set[1]
    assert {s.name for s in variants((arch,))} == names(arch, DEFAULT_SETS)  # the catalogue's default


def test_hopper_sync_check_is_the_sm100a_paths_on_sm90a():
    """sm90a's hopper_sync_check holds exactly the sm100a default variants that sm90a's default paths do not run
    (mma.sync where sm90a runs wgmma), under their sm90a names; no other arch has one."""
    sync_check = names("sm90a", (HOPPER_SYNC_CHECK,))
    blackwell = {n.removesuffix("_sm100a") + "_sm90a" for n in names("sm100a", (DEFAULT,))}
    assert sync_check == blackwell - names("sm90a", (DEFAULT,))
    assert sync_check and all("_mmasync_" in n for n in sync_check)
    assert {"block_scores", "select", "sparse_fwd", "sparse_kl", "sparse_bwd", "sparse_bwd_proxy"} == \
        {s.op for s in variants(("sm90a",), sets=(HOPPER_SYNC_CHECK,))}
    for arch in ("sm100a", "sm100f"):
        assert not names(arch, (HOPPER_SYNC_CHECK,))


def test_alternates_are_opt_in_and_their_shipped_twins_default():
    """One A/B alternate per knob, beside the variant the default path runs in its place (sm90a, bf16, G = 4)."""
    default, opt_in = names("sm90a", (DEFAULT,)), names("sm90a", (OPT_IN,))
    pairs = {  # alternate: the default path's variant
        "sparse_fwd_bf16_d128_b128_g4_m128_t256_s2_mmawgmma_schedlockstep_sm90a":
            "sparse_fwd_bf16_d128_b128_g4_m128_t256_s1_mmawgmma_schedpingpong_sm90a",
        "sparse_fwd_bf16_d128_b128_g4_m128_t256_s2_mmawgmma_schedpingpong_sm90a":
            "sparse_fwd_bf16_d128_b128_g4_m128_t256_s1_mmawgmma_schedpingpong_sm90a",
        "sparse_kl_bf16_d128_b128_g4_m64_n128_t256_s2_mmawgmma_schedlockstep_kl1_sm90a":
            "sparse_kl_bf16_d128_b128_g4_m64_n128_t256_s1_mmawgmma_schedpingpong_kl1_sm90a",
        "sparse_combine_bf16_d128_b128_g4_t256_hw1_sr0_sm90a": "sparse_combine_bf16_d128_b128_g4_t256_hw4_sr0_sm90a",
        "sparse_bwd_bf16_d128_b128_g4_m64_n128_t256_s2_mmawgmma_tauout1_det0_sm90a":
            "sparse_bwd_bf16_d128_b128_g4_m64_n128_t384_s2_mmawgmma_tauout1_det0_sm90a",
        "sparse_bwd_proxy_bf16_d128_b128_g4_m64_n128_t256_s2_mmawgmma_headsstepped_det0_kl0_sm90a":
            "sparse_bwd_proxy_bf16_d128_b128_g4_m64_n128_t256_s2_mmawgmma_headsresident_det0_kl0_sm90a",
        "warmup_kl_bf16_d128_g4_m128_n64_t256_s2_schedlockstep_kl1_sm90a":
            "warmup_kl_bf16_d128_g4_m128_n64_t288_s2_schedpingpong_kl1_sm90a",
        "plan_lists_b128_k16_phasescatter_t128_sm90a": "plan_lists_b128_k16_phasescatter_t512_sm90a",
    }
    for alternate, shipped in pairs.items():
        assert alternate in opt_in and shipped in default, (alternate, shipped)
    # with no producer warpgroup at G >= 8 and no resident heads there, the 256-thread / stepped kernels ship
    assert "sparse_bwd_bf16_d128_b128_g8_m64_n128_t256_s2_mmawgmma_tauout1_det0_sm90a" in default
    assert "sparse_bwd_proxy_bf16_d128_b128_g8_m64_n128_t256_s2_mmawgmma_headsstepped_det0_kl0_sm90a" in default
    # deferred KL mode's warmup kernels ship: the proxy lse alone (group 1 serves every G) and the proxy backward
    # that forms the KL value (G <= 4, one launch per group)
    assert "warmup_kl_bf16_d128_g1_m128_n64_t288_s2_schedpingpong_kl0_sm90a" in default
    assert "warmup_bwd_proxy_bf16_d128_g4_m128_n64_t256_kl1_sm90a" in default
    # the deterministic backward is sm90a's alone: its sums are opt-in elsewhere
    assert "slot_sum_bf16_d128_b128_g4_t256_sm90a" in default
    assert "slot_sum_bf16_d128_b128_g4_t256_sm100a" in names("sm100a", (OPT_IN,))


def test_explicit_choices_keep_their_sets():
    """--block-size 64 builds the block-64 variants of the sets asked for (a variant's set follows from its other
    fields)."""
    fwd = variants(("sm90a",), block_sizes=(64,), only=["sparse_fwd_*"])
    assert {s.build_set for s in fwd} == {DEFAULT, HOPPER_SYNC_CHECK} and all("_b64_" in s.name for s in fwd)
    scores = variants(("sm90a",), block_sizes=(64,), only=["block_scores_*"])
    assert {s.build_set for s in scores} == {DEFAULT, HOPPER_SYNC_CHECK} and all("_b64_" in s.name for s in scores)


def test_parse_sets():
    assert parse_sets("all") == SETS
    assert parse_sets("opt_in;default") == (OPT_IN, DEFAULT)
    assert parse_sets([HOPPER_SYNC_CHECK]) == (HOPPER_SYNC_CHECK,)
    for bad in ("nightly", ",", ""):
        with pytest.raises(CatalogueError, match="build set|no build set"):
            parse_sets(bad)


def test_cli_builds_the_default_sets_unless_asked(capsys, monkeypatch):
    monkeypatch.delenv(BUILD_SET_ENV, raising=False)

    def listed(*argv):
        assert main(["list", "--arch", "sm90a", "--out", "/nonexistent", *argv]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.endswith("not built")]
        return {row[0]: row[1] for row in rows}

    default = listed()
    assert set(default.values()) == set(DEFAULT_SETS) and set(default) == names("sm90a", DEFAULT_SETS)
    assert set(listed("--set", "opt_in").values()) == {OPT_IN}
    assert len(listed("--set", "all")) == len(variants(("sm90a",), sets="all"))
    monkeypatch.setenv(BUILD_SET_ENV, "opt_in")
    assert set(listed()) == names("sm90a", (OPT_IN,))
    assert main(["list", "--set", "nightly", "--out", "/nonexistent"]) == 2
    assert "build set 'nightly'" in capsys.readouterr().err
