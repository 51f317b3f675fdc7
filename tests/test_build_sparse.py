"""The sparse attention kernels (forward, combine, KL, backward, proxy backward) build for Hopper and Blackwell
with no GPU: PTX params equal the declared ABI, no local memory, shared memory as the spec declares. One G each
(the others differ in constants only; the catalogue builds them all)."""

import json

import pytest

pytest.importorskip("cutlass", reason="the build-stage tests need nvidia-cutlass-dsl (pip install '.[test]')")

from build_tools import ptx as ptx_facts  # noqa: E402
from build_tools.build import build  # noqa: E402
from flash_msa_rt.manifest import Manifest, param_layout  # noqa: E402
from kernels_src import sparse_bwd, sparse_fwd  # noqa: E402
from kernels_src.catalogue import variants  # noqa: E402

FAMILIES = ("sparse_fwd", "sparse_combine", "sparse_kl", "sparse_bwd", "sparse_bwd_proxy")


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_sparse_kernels_build(tmp_path, arch):
    specs = [s for s in variants((arch,), only=["sparse_*_bf16_*g4_*"]) if s.op in FAMILIES]
    assert sorted(s.op for s in specs) == sorted(FAMILIES)
    outcomes = build(specs, tmp_path, jobs=2, progress=False)
    assert all(o.status == "built" for o in outcomes), outcomes
    manifest = Manifest.from_json(json.loads((tmp_path / arch / "manifest.json").read_text()))
    for s in specs:
        v = manifest.variants[s.name]
        assert v.local_bytes == 0, (s.name, v.local_bytes)
        assert v.smem_bytes == s.smem_bytes <= 227 * 1024
        ptx = (tmp_path / arch / "ptx" / f"{s.name}.ptx").read_text()
        assert ptx_facts.single_entry(ptx).params == param_layout(s.params)


def test_sparse_kernels_refuse_what_they_cannot_run():
    ok, reason = sparse_fwd.can_implement(sparse_fwd.Config(group=3), "sm90a")
    assert not ok and "group" in reason
    ok, reason = sparse_fwd.can_implement(sparse_fwd.Config(head_dim=64), "sm90a")
    assert not ok and "head dims" in reason
    ok, reason = sparse_bwd.can_implement(sparse_bwd.Config(block_size=64), "sm90a")
    assert not ok and "block_size 64" in reason
    ok, reason = sparse_fwd.can_implement(sparse_fwd.Config(dtype="f32"), "sm90a")
    assert not ok and "dtype" in reason
