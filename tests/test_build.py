"""The build stage for real (CuTeDSL compiles, no GPU): manifest, hashes, ABI against PTX, incrementality."""

import dataclasses
import hashlib
import importlib.metadata
import json

import pytest

pytest.importorskip("cutlass", reason="the build-stage tests need nvidia-cutlass-dsl (pip install '.[test]')")

from build_tools import cubin as cubin_facts  # noqa: E402
from build_tools import ptx as ptx_facts  # noqa: E402
from build_tools.build import BuildError, build, check_compiled, is_up_to_date, variant_fingerprint  # noqa: E402
from flash_msa_rt.manifest import Manifest, param_layout  # noqa: E402
from kernels_src.catalogue import variants  # noqa: E402
from kernels_src.spec import Compiled  # noqa: E402

# The smallest useful set: one variant per arch (sm100a and sm100f prove the Blackwell side of the build).
ONLY = ["block_scores_bf16_d64_b128_*"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts")
    specs = variants(("sm90a", "sm100a", "sm100f"), only=ONLY)
    assert {s.arch for s in specs} == {"sm90a", "sm100a", "sm100f"}
    outcomes = build(specs, out, jobs=2, progress=False)
    failed = [o for o in outcomes if o.status != "built"]
    assert not failed, failed
    return out, specs


def test_manifest_describes_every_cubin(built):
    out, specs = built
    for arch in ("sm90a", "sm100a", "sm100f"):
        raw = json.loads((out / arch / "manifest.json").read_text())
        m = Manifest.from_json(raw)
        assert m.fingerprint["cutlass_dsl"] == importlib.metadata.version("nvidia-cutlass-dsl")
        assert len(m.fingerprint["kernels_src_sha256"]) == 64
        mine = [s for s in specs if s.arch == arch]
        assert sorted(m.variants) == sorted(s.name for s in mine)
        for v in m.variants.values():
            data = (out / arch / v.cubin).read_bytes()
            assert hashlib.sha256(data).hexdigest() == v.sha256
            assert v.entry and v.registers > 0 and v.local_bytes == 0
            assert v.fingerprint.startswith(f"cutlass_dsl={m.fingerprint['cutlass_dsl']};")
            assert v.block[0] > 0 and v.smem_bytes > 0 and len(v.grid) == 3


def test_ptx_and_cubin_agree_with_the_declared_abi(built):
    out, specs = built
    for s in specs:
        ptx = (out / s.arch / "ptx" / f"{s.name}.ptx").read_text()
        entry = ptx_facts.single_entry(ptx)
        assert entry.params == param_layout(s.params)
        target = {"sm90a": ".target sm_90a", "sm100a": ".target sm_100a", "sm100f": ".target sm_100f"}[s.arch]
        assert target in ptx
        (k,) = cubin_facts.kernels((out / s.arch / f"{s.name}.cubin").read_bytes())
        assert k.name == entry.name
        if k.param_sizes:
            assert k.param_sizes == [p.size for p in s.params]


def test_second_build_is_incremental(built):
    out, specs = built
    outcomes = build(specs, out, jobs=2, progress=False)
    assert {o.status for o in outcomes} == {"up-to-date"}


def test_changes_that_force_a_rebuild(built, tmp_path):
    out, specs = built
    s = specs[0]
    m = Manifest.load(out / s.arch / "manifest.json")
    entry = m.variants[s.name]
    assert is_up_to_date(entry, entry.fingerprint, out / s.arch)
    # Another spec (e.g. a changed grid rule) or toolchain gives another fingerprint.
    changed = dataclasses.replace(s, grid=("1", "1", "1"))
    assert variant_fingerprint(changed, "4.8.1", "c") != variant_fingerprint(s, "4.8.1", "c")
    assert variant_fingerprint(s, "4.9.0", "c") != variant_fingerprint(s, "4.8.1", "c")
    # A damaged cubin is rebuilt, not trusted.
    copy = tmp_path / s.arch
    copy.mkdir()
    (copy / entry.cubin).write_bytes((out / s.arch / entry.cubin).read_bytes()[:-1])
    assert not is_up_to_date(entry, entry.fingerprint, copy)


def test_build_prunes_variants_of_changed_sources(built, tmp_path):
    """A manifest entry outside the build compiled from sources this checkout no longer holds (the catalogue
    renamed it, or its family changed since) goes with its files; one from the current sources stays."""
    import shutil

    out, specs = built
    s = specs[0]
    arch_dir = tmp_path / s.arch
    shutil.copytree(out / s.arch, arch_dir)
    m = Manifest.load(arch_dir / "manifest.json")
    entry = m.variants[s.name]
    tag = f"src:kernels_src/{s.op}="
    old_hash = "0" * 16
    fields = [f"{tag}{old_hash}" if f.startswith(tag) else f for f in entry.fingerprint.split(";")]
    stale = dataclasses.replace(entry, name=s.name + "_old", cubin=s.name + "_old.cubin", fingerprint=";".join(fields))
    current = dataclasses.replace(entry, name=s.name + "_d64", cubin=s.name + "_d64.cubin")
    for e in (stale, current):
        m.variants[e.name] = e
        (arch_dir / e.cubin).write_bytes((arch_dir / entry.cubin).read_bytes())
        (arch_dir / "ptx" / f"{e.name}.ptx").write_text("")
    (arch_dir / "manifest.json").write_text(m.dumps())

    outcomes = build([s], tmp_path, jobs=1, progress=False)
    assert {(o.name, o.status) for o in outcomes} == {(s.name, "up-to-date"), (stale.name, "pruned")}
    after = Manifest.load(arch_dir / "manifest.json")
    assert sorted(after.variants) == sorted([s.name, current.name])
    assert not (arch_dir / stale.cubin).exists() and not (arch_dir / "ptx" / f"{stale.name}.ptx").exists()
    assert (arch_dir / current.cubin).exists()


def test_build_checks_fail_loudly(built, monkeypatch):
    out, specs = built
    s = specs[0]
    compiled = Compiled(cubin=(out / s.arch / f"{s.name}.cubin").read_bytes(),
                        ptx=(out / s.arch / "ptx" / f"{s.name}.ptx").read_text(), smem_bytes=s.smem_bytes)
    check_compiled(s, compiled)
    with pytest.raises(BuildError, match="differ from the declared ABI"):
        check_compiled(dataclasses.replace(s, params=s.params[:-1]), compiled)
    with pytest.raises(BuildError, match="dynamic shared memory"):
        check_compiled(dataclasses.replace(s, smem_bytes=s.smem_bytes + 16), compiled)
    real = cubin_facts.kernels(compiled.cubin)
    spilling = [dataclasses.replace(k, frame_bytes=32) for k in real]
    monkeypatch.setattr(cubin_facts, "kernels", lambda data: spilling)
    with pytest.raises(BuildError, match="32 bytes of local memory"):
        check_compiled(s, compiled)
    check_compiled(dataclasses.replace(s, hot=False), compiled)  # cold kernels may use a stack frame


def test_runtime_reads_what_the_build_wrote(built, artifact_dir_env):
    from flash_msa_rt import artifacts
    from flash_msa_rt.errors import MissingVariantError

    out, specs = built
    artifact_dir_env(out)
    for s in specs:
        entry, arch_dir = artifacts.find_variant(s.op, s.config, s.arch)
        assert entry.name == s.name
        assert artifacts.cubin_bytes(entry, arch_dir)[:4] == b"\x7fELF"
    with pytest.raises(MissingVariantError, match=f"nearest available: {specs[0].name}"):
        artifacts.find_variant(specs[0].op, dict(specs[0].config, block_size=64), specs[0].arch)


def test_installed_wheel_carries_verified_artifacts():
    """The installed flash-msa (pip install '.[test]', as the README says) carries manifests and cubins."""
    try:
        dist = importlib.metadata.distribution("flash-msa")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("flash-msa is not installed in this environment (only the source tree is tested)")
    files = [f for f in dist.files or [] if "_artifacts" in str(f)]
    manifests = [f for f in files if f.name == "manifest.json"]
    assert manifests, "the installed package carries no artifacts"
    archs = dist.version.split("+", 1)[1].split(".") if "+" in dist.version else []
    assert sorted(f.parent.name for f in manifests) == sorted(archs), (dist.version, manifests)
    for f in manifests:
        path = dist.locate_file(f)
        m = Manifest.load(path)
        assert m.variants, f"{f} lists no variants"
        for v in m.variants.values():
            assert hashlib.sha256((path.parent / v.cubin).read_bytes()).hexdigest() == v.sha256


def test_fingerprint_covers_the_families_a_kernel_imports():
    """A change to block_scores' score tiles must rebuild select, and one to the backward's kernel class the KL
    pass built on it: the fingerprint hashes every kernels_src package a family imports, transitively."""
    from build_tools.build import family_packages

    assert family_packages("block_scores") == ["block_scores"]
    assert family_packages("select") == ["block_scores", "select"]
    assert {"sparse_bwd_proxy", "sparse_bwd"} <= set(family_packages("sparse_kl"))
    # the shared compile machinery is a top-level module (kernels_src.compile, in common_hash), not a family's:
    # a change to block_scores no longer rebuilds every tile kernel
    assert "block_scores" not in family_packages("sparse_bwd")
    spec = next(s for s in variants(["sm90a"]) if s.op == "sparse_kl")
    assert "src:kernels_src/sparse_bwd=" in variant_fingerprint(spec, "4.8.1", "c")
