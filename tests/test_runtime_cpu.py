"""The runtime's validation, packing, caching and errors, with the driver replaced by a recorder."""

import hashlib
import struct

import pytest
import torch

from fakes import FakeCudaTensor, FakeDriver
from flash_msa_rt import artifacts, loader
from flash_msa_rt.arch import arch_for_capability
from flash_msa_rt.errors import ArtifactError, LaunchError, MissingVariantError, NoGPUError, UnsupportedArchError
from flash_msa_rt.manifest import (Manifest, ScalarParam, TensorParam, TmaCoordParam, TmaParam, VariantEntry,
                                   ZerosParam, variant_name)

CONFIG = {"dtype": "bf16", "head_dim": 128, "block_size": 128}
OP = "toy"
CUBIN = b"\x7fELF not really a cubin"


def toy_entry(arch="sm90a", config=CONFIG, cubin=CUBIN, fingerprint="cutlass_dsl=4.8.1;spec=1"):
    name = variant_name(OP, config, arch)
    params = (
        TmaParam("tma_q", "q", dims=(3, 1, 2, 0), box=(64, 128, 1, 1), swizzle=128, dtype="bf16",
                 shape=("B", "S", "H", 128)),
        TmaCoordParam("q_coord", "q", dynamic_modes=3),
        TensorParam("out", "f32", ("B", "H", "S", "NB"), ("i64", "i64", "i64", 1), divisibility={"NB": 1}),
        ScalarParam("scale", "f32"),
        ScalarParam("group", "i32"),
        ZerosParam("mma_state", 1),
    )
    return VariantEntry(name=name, op=OP, arch=arch, config=dict(config), params=params,
                        grid=("ceil_div(S, 128)", "H", "B"), block=(128, 1, 1), smem_bytes=65536,
                        cubin=f"{name}.cubin", sha256=hashlib.sha256(cubin).hexdigest(), entry="kernel_toy",
                        registers=80, fingerprint=fingerprint)


def write_artifacts(root, entries, cubin=CUBIN, toolchain="4.8.1"):
    for arch in {e.arch for e in entries}:
        d = root / arch
        d.mkdir(parents=True, exist_ok=True)
        mine = {e.name: e for e in entries if e.arch == arch}
        for e in mine.values():
            (d / e.cubin).write_bytes(cubin)
        m = Manifest(arch=arch, fingerprint={"cutlass_dsl": toolchain, "kernels_src_sha256": "x"}, variants=mine)
        (d / "manifest.json").write_text(m.dumps())


@pytest.fixture
def toy(tmp_path, artifact_dir_env, monkeypatch):
    entry = toy_entry()
    write_artifacts(tmp_path, [entry])
    artifact_dir_env(tmp_path)
    fake = FakeDriver([p.size for p in entry.params])
    fake.install(monkeypatch)
    return entry, fake


def toy_args(B=2, S=1000, H=4, NB=8, **kw):
    args = dict(q=FakeCudaTensor((B, S, H, 128)), out=FakeCudaTensor((B, H, S, NB), torch.float32, address=0x7E00000000),
                scale=0.125, group=2)
    args.update(kw)
    return args


def test_arch_mapping():
    assert arch_for_capability(9, 0) == "sm90a"
    assert arch_for_capability(10, 0) == "sm100a"
    assert arch_for_capability(10, 0, carried=["sm100f"]) == "sm100f"  # the family build also runs on 10.0
    assert arch_for_capability(10, 0, carried=["sm100a", "sm100f"]) == "sm100a"  # exact target preferred
    assert arch_for_capability(10, 3, carried=["sm100a"]) == "sm100f"  # sm_100a SASS does not run on 10.3
    with pytest.raises(UnsupportedArchError, match=r"A100 has compute capability 8\.0.*sm90a"):
        arch_for_capability(8, 0, device_name="A100")
    with pytest.raises(UnsupportedArchError, match="12.0"):
        arch_for_capability(12, 0)


def test_no_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoGPUError, match="no CUDA device"):
        loader.device_arch(0)


def test_launch_packs_every_param(toy):
    entry, fake = toy
    k = loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))
    args = toy_args()
    k(**args)
    (launch,) = fake.launches
    assert launch["grid"] == (8, 4, 2) and launch["block"] == (128, 1, 1) and launch["smem"] == 65536
    assert launch["stream"] == 1234 and launch["func"] == "func:kernel_toy"
    tma, coord, out, scale, group, zeros = launch["params"]
    assert tma == b"\xab" * 128
    assert struct.unpack("<3i", coord) == (2, 1000, 4)  # the dynamic extents of q, in mode order
    ptr, b, h, s, nb, st0, st1, st2 = struct.unpack("<Q4i3q", out)
    assert (ptr, b, h, s, nb) == (0x7E00000000, 2, 4, 1000, 8)
    assert (st0, st1, st2) == args["out"].stride()[:3]
    assert struct.unpack("<f", scale) == (0.125,) and struct.unpack("<i", group) == (2,) and zeros == b"\0"
    (enc,) = fake.encodes
    q = args["q"]
    assert enc["dims"] == [128, 1000, 4, 2]  # innermost first: D, S, H, B
    assert enc["strides"] == [q.stride(1) * 2, q.stride(2) * 2, q.stride(0) * 2]
    assert enc["box"] == [64, 128, 1, 1] and enc["swizzle"] == 128 and enc["dtype"] == 9
    assert enc["span"] == 2 * 1000 * 4 * 128 * 2


def test_cached_launch_skips_validation_and_encoding(toy):
    entry, fake = toy
    k = loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))
    args = toy_args()
    for _ in range(3):
        k(**args)
    assert len(fake.encodes) == 1 and len(fake.launches) == 3
    assert len(k._plans) == 1
    # A new pointer with the same layout re-encodes the descriptor but reuses the validated plan.
    k(**dict(args, q=FakeCudaTensor((2, 1000, 4, 128), address=0x7F0000100000)))
    assert len(fake.encodes) == 2 and len(k._plans) == 1
    assert loader.get_kernel(OP, CONFIG, torch.device("cuda", 0)) is k
    assert len(fake.loaded) == 1  # loaded once, lazily


@pytest.mark.parametrize("change, error, message", [
    (dict(q=FakeCudaTensor((2, 1000, 4, 128), torch.float16)), TypeError, "dtype torch.float16"),
    (dict(q=FakeCudaTensor((2, 1000, 4, 64))), ValueError, r"shape\[3\] is 64; this variant was compiled for 128"),
    (dict(q=FakeCudaTensor((2, 999, 4, 128))), ValueError, "S = 999, but"),
    (dict(q=FakeCudaTensor((2, 1000, 128))), ValueError, "has 3 dims"),
    (dict(q=FakeCudaTensor((2, 1000, 4, 128), address=0x7F0000000008)), ValueError, "16-byte aligned"),
    (dict(out=FakeCudaTensor((2, 4, 1000, 8), torch.float32, stride=(64000, 16000, 16, 2))), ValueError,
     r"stride\[3\] is 2"),
    (dict(q=FakeCudaTensor((2, 1000, 4, 128), stride=(1000 * 4 * 136, 4 * 136, 136, 1))), None, None),
    (dict(q=FakeCudaTensor((2, 1000, 4, 128), stride=(1000 * 4 * 132, 4 * 132, 131, 1))), ValueError,
     "multiple of 16 bytes"),
    (dict(group=2.5), TypeError, "scalar group must be an int"),
    (dict(scale=float("nan")), ValueError, "must be finite"),
    (dict(q=torch.zeros(3)), ValueError, "argument q is on cpu"),
    (dict(q="q"), TypeError, "must be a torch.Tensor"),
])
def test_validation_names_argument_value_and_support(toy, change, error, message):
    k = loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))
    args = toy_args(**change)
    if error is None:
        k(**args)  # a padded row stride that stays 16-byte aligned is fine
        return
    with pytest.raises(error, match=message):
        k(**args)


def test_int32_range_is_checked(toy):
    k = loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))
    big = FakeCudaTensor((1, 2**31, 4, 128), stride=(0, 0, 0, 1))  # stride 0: no memory behind it
    out = FakeCudaTensor((1, 4, 2**31, 8), torch.float32, stride=(0, 0, 0, 1))
    with pytest.raises(ValueError, match="outside 1..2147483647"):
        k(**toy_args(q=big, out=out))


def test_missing_argument_and_wrong_device(toy):
    k = loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))
    args = toy_args()
    del args["out"]
    with pytest.raises(TypeError, match=r"missing arguments \['out'\]"):
        k(**args)
    other = FakeCudaTensor((2, 1000, 4, 128))
    other.device = torch.device("cuda", 1)
    with pytest.raises(ValueError, match="is on cuda:1"):
        k(**toy_args(q=other))


def test_missing_variant_lists_nearest_and_build_command(toy):
    with pytest.raises(MissingVariantError) as e:
        loader.get_kernel(OP, dict(CONFIG, head_dim=64), torch.device("cuda", 0))
    msg = str(e.value)
    assert "toy_bf16_d64_b128_sm90a" in msg and "nearest available: toy_bf16_d128_b128_sm90a" in msg
    assert "python -m build_tools build --arch sm90a --dtype bf16 --head-dim 64 --block-size 128" in msg


def test_missing_arch_names_the_wheel_and_command(toy, monkeypatch):
    monkeypatch.setattr(loader, "device_arch", lambda index: "sm100a")
    with pytest.raises(MissingVariantError, match=r"no sm100a artifacts.*flash-msa-rt\[sm100a\].*FLASH_MSA_ARCHS=sm100a pip install"):
        loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))


def test_corrupt_cubin_is_refused(tmp_path, artifact_dir_env, monkeypatch):
    entry = toy_entry()
    write_artifacts(tmp_path, [entry])
    (tmp_path / "sm90a" / entry.cubin).write_bytes(CUBIN + b"!")
    artifact_dir_env(tmp_path)
    FakeDriver([p.size for p in entry.params]).install(monkeypatch)
    with pytest.raises(ArtifactError, match="is corrupt: sha256"):
        loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))


def test_other_toolchain_is_refused(tmp_path, artifact_dir_env):
    write_artifacts(tmp_path, [toy_entry(fingerprint="cutlass_dsl=4.7.0;spec=1")])
    artifact_dir_env(tmp_path)
    with pytest.raises(ArtifactError, match="built by another toolchain"):
        artifacts.find_variant(OP, CONFIG, "sm90a")


def test_corrupt_manifest_is_refused(tmp_path, artifact_dir_env):
    (tmp_path / "sm90a").mkdir()
    (tmp_path / "sm90a" / "manifest.json").write_text('{"schema": 1, "arch": "sm90a"')
    artifact_dir_env(tmp_path)
    with pytest.raises(ArtifactError, match="corrupt"):
        artifacts.find_variant(OP, CONFIG, "sm90a")


def test_stale_sources_are_refused(tmp_path, artifact_dir_env, monkeypatch):
    family = tmp_path / "src" / OP
    family.mkdir(parents=True)
    (family / "__init__.py").write_text("X = 1\n")
    monkeypatch.setattr(artifacts, "SOURCE_KERNELS", tmp_path / "src")
    artifacts._source_family_hash.cache_clear()
    from flash_msa_rt.manifest import source_hash
    good = f"cutlass_dsl=4.8.1;src:kernels_src/{OP}={source_hash(family)[:16]};spec=1"
    write_artifacts(tmp_path / "a", [toy_entry(fingerprint=good)])
    artifact_dir_env(tmp_path / "a")
    artifacts.find_variant(OP, CONFIG, "sm90a")
    (family / "__init__.py").write_text("X = 2\n")
    artifacts._source_family_hash.cache_clear()
    with pytest.raises(ArtifactError, match="built from other sources"):
        artifacts.find_variant(OP, CONFIG, "sm90a")
    artifacts._source_family_hash.cache_clear()


def test_loaded_param_sizes_must_match_the_manifest(tmp_path, artifact_dir_env, monkeypatch):
    entry = toy_entry()
    write_artifacts(tmp_path, [entry])
    artifact_dir_env(tmp_path)
    FakeDriver([p.size for p in entry.params][:-1] + [32]).install(monkeypatch)
    with pytest.raises(LaunchError, match="do not match the manifest"):
        loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))


def test_descriptors_are_reused_when_only_another_argument_moves(toy):
    entry, fake = toy
    k = loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))
    args = toy_args()
    k(**args)
    for i in range(3):  # a fresh output each call: q's descriptor stays valid
        k(**dict(args, out=FakeCudaTensor((2, 4, 1000, 8), torch.float32, address=0x7D00000000 + i * 4096)))
    assert len(fake.encodes) == 1 and len(fake.launches) == 4
    assert {l["params"][0] for l in fake.launches} == {b"\xab" * 128}


def test_unloadable_cubin_names_the_driver_requirement(toy, monkeypatch):
    from flash_msa_rt import driver

    def refuse(image):
        raise LaunchError("cuLibraryLoadData failed: CUDA_ERROR_UNSUPPORTED_PTX_VERSION (...)")

    monkeypatch.setattr(driver, "load_library", refuse)
    monkeypatch.setattr(driver, "driver_version", lambda: 12080)
    with pytest.raises(LaunchError, match=r"driver \(CUDA 12.8\) could not load.*CUDA 13 driver \(R580"):
        loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))
