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


def test_select_refuses_what_it_cannot_hold():
    ok, reason = can_implement(Config(max_k=24), "sm90a")
    assert not ok and "max_k 24" in reason
    ok, reason = can_implement(Config(dtype="f32"), "sm90a")
    assert not ok and "dtype" in reason
