"""The sparse attention kernels (forward, combine, KL, KL merge, backward, proxy backward) build for Hopper and
Blackwell with no GPU: PTX params equal the declared ABI, no local memory, shared memory as the spec declares. One G each
(the others differ in constants only; the catalogue builds them all)."""

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="the build-stage tests need nvidia-cutlass-dsl (pip install '.[test]')")

from build_tools import ptx as ptx_facts  # noqa: E402
from build_tools.build import build  # noqa: E402
from flash_msa_rt.manifest import Manifest, param_layout  # noqa: E402
from kernels_src import sparse_bwd, sparse_fwd  # noqa: E402
from kernels_src.catalogue import variants  # noqa: E402

FAMILIES = ("sparse_fwd", "sparse_combine", "sparse_kl", "sparse_combine_kl", "sparse_bwd", "sparse_bwd_proxy")


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_sparse_kernels_build(tmp_path, arch):
    specs = [s for s in variants((arch,), sets="all", only=["sparse_*_bf16_*g4_*", "sparse_combine_kl_*"],
                                 head_dims=(128,)) if s.op in FAMILIES]
    # Every build set (the A/B alternates too). The combine three times on both: the widest heads per warp
    # (shipped), the same with attention sinks (scale_rows 1) and one head per warp (A/B runs).
    # sm90a builds every family but the combines twice: mma.sync and wgmma (Hopper only); the forward and the KL
    # pass on wgmma once more each, with their warpgroups in ping-pong (the forward twice: one and two q buffers),
    # the proxy backward with resident heads, and the main backward writing tau, with atomics and deterministic
    # (the proxy kernel reading it is built at g1 only), the atomic one also warp-specialised (a producer warpgroup)
    extra = ["sparse_fwd", "sparse_fwd", "sparse_fwd", "sparse_kl", "sparse_kl", "sparse_bwd", "sparse_bwd",
             "sparse_bwd", "sparse_bwd", "sparse_bwd_proxy", "sparse_bwd_proxy"] if arch == "sm90a" else []
    assert sorted(s.op for s in specs) == sorted([*FAMILIES, "sparse_combine", "sparse_combine", *extra])
    outcomes = build(specs, tmp_path, jobs=2, progress=False)
    assert all(o.status == "built" for o in outcomes), outcomes
    manifest = Manifest.from_json(json.loads((tmp_path / arch / "manifest.json").read_text()))
    for s in specs:
        v = manifest.variants[s.name]
        assert v.local_bytes == 0, (s.name, v.local_bytes)
        assert v.smem_bytes == s.smem_bytes <= 227 * 1024
        ptx = (tmp_path / arch / "ptx" / f"{s.name}.ptx").read_text()
        assert ptx_facts.single_entry(ptx).params == param_layout(s.params)
        if s.op == "sparse_combine":  # a lane's share of a slot: 4 heads x 128 / 32 = 16 elements, two 16-byte loads
            wide = "_hw4_" in s.name
            assert (ptx.count("ld.global.v4.b32") == 2 and ptx.count("st.global.v4.b32") == 2) == wide, s.name
        if s.op == "sparse_fwd" and "_s1_" in s.name:  # one q buffer: two CTAs of 256 threads share the SM
            assert v.registers <= 128 and 2 * v.smem_bytes <= 227 * 1024, (s.name, v.registers, v.smem_bytes)
        if s.op == "sparse_bwd":  # the deterministic variant stores its dq rows and takes turns at its atomics
            det = "_det1_" in s.name
            assert "red.global.add" in ptx, s.name
            assert ("cp.reduce.async.bulk" in ptx) != det, s.name
            assert ("cp.async.bulk.global.shared::cta" in ptx) == det, s.name
            assert ("ld.acquire.gpu" in ptx and "st.release.gpu" in ptx) == det, s.name
            producer = "_t384_" in s.name  # registers move to the consumers; the stages are handed over by mbarrier
            assert ("setmaxnreg.inc.sync.aligned.u32" in ptx and "setmaxnreg.dec.sync.aligned.u32" in ptx and
                    "cp.async.mbarrier.arrive.noinc" in ptx and ".minnctapersm 1" in ptx) == producer, s.name


def test_sparse_kernels_refuse_what_they_cannot_run():
    from kernels_src import sparse_combine

    for hw in (3, 8):  # not a divisor of G = 4; more than 16 elements per lane at D = 128
        ok, reason = sparse_combine.can_implement(sparse_combine.Config(group=4, heads_per_warp=hw), "sm90a")
        assert not ok and f"heads_per_warp {hw}" in reason, reason
    ok, reason = sparse_fwd.can_implement(sparse_fwd.Config(group=3), "sm90a")
    assert not ok and "group" in reason
    ok, reason = sparse_fwd.can_implement(sparse_fwd.Config(head_dim=96), "sm90a")
    assert not ok and "head_dim 96" in reason
    ok, reason = sparse_bwd.can_implement(sparse_bwd.Config(block_size=32), "sm90a")
    assert not ok and "block_size 32" in reason
    wide = sparse_bwd.MainConfig(head_dim=256, block_size=64, tile_n=64, mma="wgmma")  # two gather stages
    ok, reason = sparse_bwd.can_implement(wide, "sm90a")  # the matrix's measured limit
    assert not ok and "288768 bytes of shared memory" in reason
    assert sparse_bwd.can_implement(dataclasses.replace(wide, stages=1), "sm90a")[0]
    assert sparse_bwd.can_implement(dataclasses.replace(wide, stages=1, mma="sync"), "sm100a")[0]
    tau = sparse_bwd.MainConfig(mma="wgmma", tile_n=128, tau_out=1, threads=sparse_bwd.PRODUCER_THREADS)
    assert sparse_bwd.can_implement(tau, "sm90a")[0]
    for bad in (dict(group=8), dict(deterministic=1), dict(tau_out=0)):
        ok, reason = sparse_bwd.can_implement(dataclasses.replace(tau, **bad), "sm90a")
        assert not ok and "the producer warp" in reason, (bad, reason)
    ok, reason = sparse_fwd.can_implement(sparse_fwd.Config(dtype="f32"), "sm90a")
    assert not ok and "dtype" in reason
    ok, reason = sparse_fwd.can_implement(sparse_fwd.Config(mma="wgmma"), "sm100a")
    assert not ok and "sm90a only" in reason
    ok, reason = sparse_fwd.can_implement(sparse_fwd.Config(mma="wgmma", schedule="pingpong", stages=1, group=1),
                                          "sm90a")
    assert not ok and "stages 2 builds" in reason
    ok, reason = sparse_fwd.can_implement(sparse_fwd.Config(mma="wgmma", stages=1), "sm90a")
    assert not ok and "stages 1 not supported with schedule 'lockstep'" in reason


def test_wgmma_register_layouts():
    """The wgmma forward feeds P to the PV product straight from the QK accumulator's registers: for all 256
    threads, each A-fragment position must hold the (row, key) the PV MMA expects, and the O accumulator's columns
    must be where the epilogue's quad transpose assumes them; the wgmma KL pass's key groups
    are one warpgroup's 32 keys, covered once by each quad; the proxy backward's dq_p MMA partitions its
    accumulator as the score MMA (checked on cute's layouts).
    In a fresh process: wgmma atoms trace only under sm_90a, and this one may have compiled for sm_100a."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = ("from kernels_src.sparse_fwd.wgmma_check import epilogue_mismatches, kl_mismatches, "
            "kl_pingpong_mismatches, mismatches, proxy_mismatches; e = mismatches() + epilogue_mismatches() + "
            "kl_mismatches() + kl_pingpong_mismatches() + proxy_mismatches(); print(len(e)); print(e[:3])")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[0] == "0", run.stdout


def test_row_copy_layouts():
    """tiles.cp_async_rows with fewer threads per row (the gathers' ROW_THREADS): every element copied once, 8
    contiguous elements per chunk, each instruction's share of a row contiguous, one lead thread per row and pass
    (kernels_src/tiles_check.py)."""
    from kernels_src.tiles_check import mismatches

    errors = mismatches()
    assert not errors, errors[:5]
