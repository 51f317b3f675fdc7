"""The selection kernel builds for every arch (no GPU): ABI against PTX, no spills, shared memory as declared."""

import pytest

pytest.importorskip("cutlass", reason="the build-stage tests need nvidia-cutlass-dsl (pip install '.[test]')")

from build_tools import ptx as ptx_facts  # noqa: E402
from build_tools.build import build  # noqa: E402
from flash_msa_rt.manifest import Manifest, param_layout  # noqa: E402
from kernels_src.catalogue import variants  # noqa: E402
from kernels_src.select import Config, can_implement  # noqa: E402


def test_select_builds_for_hopper_and_blackwell(tmp_path):
    specs = variants(("sm90a", "sm100a"), only=["select_bf16_d128_b128_k16_*"])
    assert {s.arch for s in specs} == {"sm90a", "sm100a"}
    outcomes = build(specs, tmp_path, jobs=2, progress=False)
    assert all(o.status == "built" for o in outcomes), outcomes
    for s in specs:
        m = Manifest.from_json(__import__("json").loads((tmp_path / s.arch / "manifest.json").read_text()))
        v = m.variants[s.name]
        assert v.local_bytes == 0 and v.smem_bytes == Config(max_k=16).smem_bytes()
        # Two CTAs per SM at max_k 16 (228 KB per SM, 1 KB reserved per CTA): the occupancy the design assumes.
        assert 2 * (v.smem_bytes + 1024) <= 228 * 1024
        ptx = (tmp_path / s.arch / "ptx" / f"{s.name}.ptx").read_text()
        assert ptx_facts.single_entry(ptx).params == param_layout(s.params)


def test_select_at_dp64_builds_with_row_wide_swizzle(tmp_path):
    """At Dp 64 an e4m3 row is 64 bytes: its TMA boxes and shared-memory tiles take the 64-byte swizzle (a 128-byte
    box would be wider than the tensor; the build checks CuTeDSL's traced swizzle against the declared one), while
    16-bit rows keep 128 bytes. Each builds with its declared ABI, no spills, two K steps of wgmma per half."""
    specs = variants(("sm90a",), only=["select_e4m3_d64_b128_k16_*", "select_bf16_d64_b128_k16_*wgmma*"])
    assert len(specs) == 2
    outcomes = build(specs, tmp_path, jobs=1, progress=False)
    assert all(o.status == "built" for o in outcomes), outcomes
    m = Manifest.from_json(__import__("json").loads((tmp_path / "sm90a" / "manifest.json").read_text()))
    for s in specs:
        v = m.variants[s.name]
        tma = {p.name: p for p in v.params if p.kind == "tma"}
        want = (64, 64) if s.config_obj.dtype == "e4m3" else (128, 64)  # (swizzle bytes, box elements)
        assert {(t.swizzle, t.box[0]) for t in tma.values()} == {want}, (s.name, tma)
        assert v.local_bytes == 0 and v.smem_bytes == s.config_obj.smem_bytes()
        ptx = (tmp_path / "sm90a" / "ptx" / f"{s.name}.ptx").read_text()
        assert ptx_facts.single_entry(ptx).params == param_layout(s.params)
        k_step = 32 if s.config_obj.dtype == "e4m3" else 16
        assert ptx.count("wgmma.mma_async") == 2 * 64 // k_step, s.name


def test_select_refuses_what_it_cannot_hold():
    ok, reason = can_implement(Config(max_k=24), "sm90a")
    assert not ok and "max_k 24" in reason
    ok, reason = can_implement(Config(dtype="f32"), "sm90a")
    assert not ok and "dtype" in reason


def test_serialised_wgmma_fails_the_build():
    """ptxas serialises every wgmma when a group is waited for in a later loop step than the one that issued it
    (the first try at pipelining select, 0.87-0.93x: kernels_src/select/NOTES.md). CuTeDSL prints that warning
    only in ptxas's verbose log; the build reads it and refuses the kernel, naming the warning."""
    import cutlass
    from cutlass.cute.nvgpu import warpgroup

    import cutlass.cute as cute
    from build_tools.build import BuildError, check_compiled
    from kernels_src.compile import compile_kernel, ptxas_performance_warnings
    from kernels_src.block_scores.build import fake_args
    from kernels_src.select import params
    from kernels_src.select.wgmma import ProxySelectWG

    class AcrossSteps(ProxySelectWG):
        """Block j + 1's products issued in step j and waited for in step j + 1 (no refill: compile only)."""

        @cute.jit
        def scan_blocks(self, t, tiled_mma, warp_idx, n_blocks, m0, first_masked, quad_lane, scale, k_scale, b, pk,
                        heap, worst_score):
            cute.arch.mbarrier_wait(t.k_full, 0)
            for h in cutlass.range_constexpr(2):
                self.issue_half(t, 0, h)
            for j in cutlass.range(n_blocks, unroll=1):
                warpgroup.wait_group(1)
                maxes = self.half_row_maxes(t, 0, j, m0, first_masked)
                self.issue_half(t, j + 1, 0)
                warpgroup.wait_group(1)
                maxes += self.half_row_maxes(t, 1, j, m0, first_masked)
                self.issue_half(t, j + 1, 1)
                worst_score = self.offer(heap, maxes[0] * scale, j, worst_score)
            warpgroup.wait_group(0)

    config = Config(mma="wgmma")
    args = fake_args(params(config), "block_indices", ("k_scale",))
    shipped = compile_kernel(ProxySelectWG(config), config, "sm90a", args)
    assert shipped.ptxas_warnings == ()
    compiled = compile_kernel(AcrossSteps(config), config, "sm90a", args)
    assert any(w.startswith("C7514: Potential Performance Loss") for w in compiled.ptxas_warnings), \
        compiled.ptxas_warnings
    spec = next(s for s in variants(("sm90a",)) if s.name == config.variant_name("sm90a"))
    with pytest.raises(BuildError, match="C7514"):
        check_compiled(spec, compiled)
    log = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
           "to insufficient register resources for the function 'kernel_x'\nptxas info    : Used 128 registers")
    assert ptxas_performance_warnings(log) == ("C7512: Potential Performance Loss: wgmma.mma_async instructions "
                                               "are serialized due to insufficient register resources",)


def test_wide_schedule_builds_at_blocks_of_64_only(tmp_path):
    """Schedule "wide" (blocks of 64 scored two per 128-key step, an opt-in build): K boxes and stages of 128 keys,
    its ABI, no spills, the declared shared memory; refused at blocks of 128, on mma.sync or with other stages."""
    from kernels_src.select import build_set

    specs = variants(("sm90a",), sets="all", block_sizes=(64,), only=["select_bf16_d64_b64_k64_*schedwide*",
                                                                      "select_e4m3_d128_b64_k16_*schedwide*"])
    assert len(specs) == 2 and all(build_set(s.config_obj, "sm90a") == "opt_in" for s in specs)
    outcomes = build(specs, tmp_path, jobs=2, progress=False)
    assert all(o.status == "built" for o in outcomes), outcomes
    m = Manifest.from_json(__import__("json").loads((tmp_path / "sm90a" / "manifest.json").read_text()))
    for s in specs:
        v = m.variants[s.name]
        assert v.local_bytes == 0 and v.smem_bytes == s.config_obj.smem_bytes()
        assert {p.box[1] for p in v.params if p.name == "tma_k"} == {128}  # a step's keys, not a block's
        ptx = (tmp_path / "sm90a" / "ptx" / f"{s.name}.ptx").read_text()
        assert ptx_facts.single_entry(ptx).params == param_layout(s.params)
    # The same shared memory as the one-block loop at blocks of 128: two stages of 128 keys.
    assert Config(block_size=64, max_k=64, mma="wgmma", schedule="wide").smem_bytes() == \
        Config(block_size=128, max_k=64, mma="wgmma").smem_bytes()
    for bad, why in ((Config(block_size=128, mma="wgmma", schedule="wide"), "block_size 128"),
                     (Config(block_size=64, mma="sync", schedule="wide"), "'sync'"),
                     (Config(block_size=64, mma="wgmma", schedule="wide", stages=3), "stages 3")):
        ok, reason = can_implement(bad, "sm90a")
        assert not ok and "schedule 'wide'" in reason and why in reason, reason


def test_wide_schedule_reads_its_two_blocks_from_the_accumulator_halves():
    """The wide kernel takes block 2 js's max from the first half of a thread's accumulator columns and block
    2 js + 1's from the second: on cute's own partition, for all 128 threads (kernels_src/select/wgmma_check.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("from kernels_src.select.wgmma_check import wide_mismatches; e = wide_mismatches(); print(len(e)); "
            "print(e[:3])")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[0] == "0", run.stdout
