import dataclasses
import json

import pytest

from flash_msa_rt.manifest import (NAME_TAGS, Manifest, ManifestError, ScalarParam, TensorParam, TmaCoordParam,
                                   TmaParam, VariantEntry, ZerosParam, param_layout, variant_name)


def sample_entry(**kw) -> VariantEntry:
    params = (
        TensorParam("x", "bf16", ("M", "N"), ("i64", 1), divisibility={"N": 8}),
        ScalarParam("scale", "f32"),
        TmaParam("tma_x", "x", dims=(1, 0), box=(64, 128), swizzle=128),
        TmaCoordParam("x_coord", "x", dynamic_modes=2),
        ZerosParam("mma_state", 1),
    )
    base = dict(name="op_bf16_d128_sm90a", op="op", arch="sm90a", config={"dtype": "bf16", "head_dim": 128},
                params=params, grid=("ceil_div(M, 128)", "1", "1"), block=(128, 1, 1), smem_bytes=1024,
                cubin="op_bf16_d128_sm90a.cubin", sha256="0" * 64, entry="kernel", registers=90,
                fingerprint="cutlass_dsl=4.8.1;x=y")
    base.update(kw)
    return VariantEntry(**base)


def test_tensor_blob_layout_matches_cutedsl_abi():
    # (M, N):(LD, 1) is 24 bytes: ptr@0, M@8, N@12, LD@16 (aot-facts.md, measured).
    p = TensorParam("a", "bf16", ("M", "N"), ("i64", 1))
    assert p.layout() == [("ptr", 8, 0), ("shape[0]", 4, 8), ("shape[1]", 4, 12), ("stride[0]", 8, 16)]
    assert (p.size, p.alignment) == (24, 8)
    # Static modes leave the blob; a 32-bit stride packs after the int32 shapes and the size rounds to 8.
    q = TensorParam("b", "f32", ("B", 128, "S"), ("i32", "i32", 1))
    assert q.layout() == [("ptr", 8, 0), ("shape[0]", 4, 8), ("shape[2]", 4, 12), ("stride[0]", 4, 16),
                          ("stride[1]", 4, 20)]
    assert q.size == 24


def test_param_sizes_and_alignment():
    e = sample_entry()
    assert param_layout(e.params) == [(24, 8), (4, 4), (128, 64), (8, 4), (1, 1)]


def test_manifest_round_trip(tmp_path):
    e = sample_entry()
    m = Manifest(arch="sm90a", fingerprint={"cutlass_dsl": "4.8.1", "kernels_src_sha256": "ab"}, variants={e.name: e})
    path = tmp_path / "manifest.json"
    path.write_text(m.dumps())
    back = Manifest.load(path)
    assert back == m
    assert back.variants[e.name].params[2].box == (64, 128)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema=99), "schema"),
    (lambda d: d["variants"]["op_bf16_d128_sm90a"]["params"][0].update(kind="texture"), "kind"),
    (lambda d: d["variants"]["op_bf16_d128_sm90a"].update(arch="sm100a"), "arch"),
    (lambda d: d["variants"]["op_bf16_d128_sm90a"].update(surprise=1), "unknown fields"),
    (lambda d: d["variants"]["op_bf16_d128_sm90a"]["params"][0].update(dtype="fp7"), "dtype"),
    (lambda d: d["variants"]["op_bf16_d128_sm90a"].pop("grid"), "malformed"),
])
def test_manifest_rejects_schema_breaks(mutate, message):
    e = sample_entry()
    d = Manifest(arch="sm90a", fingerprint={"cutlass_dsl": "4.8.1"}, variants={e.name: e}).to_json()
    d = json.loads(json.dumps(d))
    mutate(d)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(d)


def test_manifest_rejects_bad_json(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(path)


def test_variant_name_is_complete_and_deterministic():
    config = {"dtype": "bf16", "head_dim": 128, "block_size": 128, "tile_m": 128}
    name = variant_name("block_scores", config, "sm90a")
    assert name == "block_scores_bf16_d128_b128_m128_sm90a"
    assert variant_name("block_scores", dict(config), "sm90a") == name
    # Changing any single field, or the arch, changes the name.
    for key in config:
        other = dict(config, **{key: "f16" if key == "dtype" else config[key] * 2})
        assert variant_name("block_scores", other, "sm90a") != name
    assert variant_name("block_scores", config, "sm100a") != name
    with pytest.raises(ManifestError, match="no name tag"):
        variant_name("op", {"mystery": 1}, "sm90a")


def test_name_tags_are_unambiguous():
    tags = [t for t in NAME_TAGS.values() if t]
    assert len(tags) == len(set(tags))
    assert sum(1 for t in NAME_TAGS.values() if not t) == 1  # only dtype goes untagged


@pytest.mark.parametrize("bad", [
    dict(box=(300, 1)), dict(swizzle=48), dict(dims=(0,), box=(1, 2)), dict(l2_promotion=32), dict(oob_fill="x"),
])
def test_tma_param_validation(bad):
    kw = dict(name="t", tensor="x", dims=(1, 0), box=(64, 128), swizzle=128)
    kw.update(bad)
    with pytest.raises(ManifestError):
        TmaParam(**kw)


def test_entry_json_is_plain_data():
    e = sample_entry()
    d = e.to_json()
    json.dumps(d)  # no dataclass or tuple leaks that JSON cannot hold
    assert VariantEntry.from_json(json.loads(json.dumps(d))) == e
    assert dataclasses.replace(e, registers=1) != e
