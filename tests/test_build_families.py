"""Every op of the catalogue compiles on every arch it is offered for, with no GPU.

The per-family build tests pick the variants whose codegen they check; this one guards the ops none of them
builds. A helper whose signature changed under one caller (plan_items' exclusive_scan, found by a full rebuild
after eab9afc) failed only there, and the CI build compiles one variant per arch, so only a test that builds
one variant of each op catches it before a GPU session does."""

import json

import pytest

pytest.importorskip("cutlass", reason="the build-stage tests need nvidia-cutlass-dsl (pip install '.[test]')")

from build_tools import ptx as ptx_facts  # noqa: E402
from build_tools.build import build  # noqa: E402
from flash_msa_rt.manifest import Manifest, param_layout  # noqa: E402
from kernels_src.catalogue import variants  # noqa: E402


def one_variant_per_op(arch: str):
    """The first variant by name of each op on arch (bf16 before f16)."""
    first = {}
    for spec in sorted(variants((arch,)), key=lambda s: s.name):
        first.setdefault(spec.op, spec)
    return list(first.values())


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_every_op_builds(tmp_path, arch):
    specs = one_variant_per_op(arch)
    ops = {s.op for s in specs}
    assert {"plan_lists", "plan_items", "select", "sparse_fwd", "sparse_bwd"} <= ops, ops
    outcomes = build(specs, tmp_path, jobs=2, progress=False)
    failed = [o for o in outcomes if o.status != "built"]
    assert not failed, failed
    manifest = Manifest.from_json(json.loads((tmp_path / arch / "manifest.json").read_text()))
    for s in specs:
        ptx = (tmp_path / arch / "ptx" / f"{s.name}.ptx").read_text()
        assert ptx_facts.single_entry(ptx).params == param_layout(s.params), s.name
        assert manifest.variants[s.name].op == s.op
