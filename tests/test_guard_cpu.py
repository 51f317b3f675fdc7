"""The first-use guard (flash_msa_rt.guard) on CPU: the driver and the device are faked, the slices replaced by ones
that pass or fail on demand; dispatch's resolution through the kernel backend is the real one (issue 38)."""

import contextlib
import json
import warnings

import pytest
import torch

from flash_msa_rt import artifacts, driver, guard, tolerances
from flash_msa_rt.manifest import Manifest, ManifestError
from flash_msa_rt.ops import dispatch, kernels
from flash_msa_rt.selftest import slices

CUDA = torch.device("cuda", 0)
MSA = {"head_dim": 128, "proxy_head_dim": 128, "block_size": 128, "group": 4, "kv_group": 8, "varlen": False}
PASS = [tolerances.Comparison("out", 1e-3, 1e-2)]
FAIL = [tolerances.Comparison("out", 5.0, 1e-2, "max error 5.000e+00 > bound 1.000e-02")]


class FakeGpu:
    """A Blackwell GPU as the guard sees it: driver version, name and UUID, capture state, and slices whose
    verdict the test chooses (recording each run)."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.driver = 13000
        self.capturing = False
        self.verdicts = {f: PASS for f in slices.SLICES}
        self.runs = []
        monkeypatch.setattr(driver, "driver_version", lambda: self.driver)
        monkeypatch.setattr(guard, "device_name_uuid", lambda index: ("NVIDIA B200", f"GPU-fake-{index}"))
        monkeypatch.setattr(guard, "_capturing", lambda: self.capturing)
        monkeypatch.setattr(guard, "_on_device", lambda index: contextlib.nullcontext())
        fakes = {f: (self._slice(f), ops) for f, (_, ops) in slices.SLICES.items()}
        monkeypatch.setattr(slices, "SLICES", fakes)

    def _slice(self, family):
        def run(ops, dtype, device, shape=slices.Shape()):
            assert ops is kernels.KERNELS.ops and device == CUDA
            self.runs.append((family, dtype) if shape == slices.Shape() else (family, dtype, shape))
            return self.verdicts.get((family, shape), self.verdicts[family])
        return run


@pytest.fixture
def gpu(monkeypatch, tmp_path, catalogue_artifacts):
    """An sm100a device whose manifest says its cubins never ran on hardware, a fresh cache directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(guard.ENV_MODE, raising=False)
    monkeypatch.delenv(guard.ENV_UNVERIFIED, raising=False)
    catalogue_artifacts("sm100a")
    _mark(tmp_path, "sm100a", False)
    return FakeGpu(monkeypatch)


def _mark(root, arch, verified):
    """Rewrite arch's manifest with hardware_verified (None: as written before the field existed)."""
    path = root / arch / "manifest.json"
    m = Manifest.load(path)
    path.write_text(Manifest(m.arch, m.fingerprint, m.variants, hardware_verified=verified).dumps())
    artifacts.load_manifest.cache_clear()


def _resolve(op="msa_forward", dtype=torch.bfloat16, **over):
    config = dict(MSA, **over)
    if op == "msa_backward":
        config.setdefault("deterministic", False)
    return dispatch.implementation(op, CUDA, dtype, **config)


def _new_process():
    """What a new process starts with: no verdicts and no resolutions in memory (the disk cache stays)."""
    dispatch.reset_warnings()


def test_a_failing_slice_falls_back_to_the_reference_with_one_warning(gpu):
    gpu.verdicts["msa"] = FAIL
    with pytest.warns(RuntimeWarning) as caught:
        impl = _resolve()
    assert impl is dispatch.reference_impl("msa_forward")
    assert len(caught) == 1, [str(w.message) for w in caught]
    text = str(caught[0].message)
    assert "failed their first-use check" in text and "max error 5.000e+00" in text and "sm100a" in text
    assert "python -m flash_msa_rt selftest" in text and "FLASH_MSA_GUARD" in text
    assert "Build the kernels" not in text  # not dispatch's missing-kernels warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the family stays on the reference, silently, for every later resolution
        assert _resolve("msa_backward") is dispatch.reference_impl("msa_backward")
        assert _resolve(group=8, kv_group=8) is dispatch.reference_impl("msa_forward")
        assert _resolve() is dispatch.reference_impl("msa_forward")  # dispatch's cache
    assert gpu.runs == [("msa", torch.bfloat16)]


def test_a_failure_is_not_cached_on_disk(gpu):
    gpu.verdicts["msa"] = FAIL
    with pytest.warns(RuntimeWarning):
        _resolve()
    _new_process()
    gpu.verdicts["msa"] = PASS  # e.g. a driver update fixed it: the next process checks again
    assert _resolve() is kernels.KERNELS.ops["msa_forward"]
    assert len(gpu.runs) == 2


def test_a_passing_slice_admits_the_kernels_once_per_family_and_dtype(gpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _resolve() is kernels.KERNELS.ops["msa_forward"]
        assert _resolve("msa_backward") is kernels.KERNELS.ops["msa_backward"]
        assert _resolve(group=8, kv_group=8) is kernels.KERNELS.ops["msa_forward"]
    assert gpu.runs == [("msa", torch.bfloat16)]
    _resolve(dtype=torch.float16)
    _resolve("block_sparse_forward", heads=8, index_heads=1, kv_group=8)
    assert gpu.runs == [("msa", torch.bfloat16), ("msa", torch.float16), ("block_sparse", torch.bfloat16)]


def test_one_family_failing_leaves_the_others_on_the_kernels(gpu):
    gpu.verdicts["block_sparse"] = FAIL
    with pytest.warns(RuntimeWarning, match="block_sparse kernels"):
        assert _resolve("block_sparse_forward", heads=8, index_heads=1, kv_group=8) is \
            dispatch.reference_impl("block_sparse_forward")
    assert _resolve() is kernels.KERNELS.ops["msa_forward"]


def test_a_crashing_slice_is_a_failure_naming_the_exception(gpu):
    def crash(ops, dtype, device, shape):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    gpu.monkeypatch.setitem(slices.SLICES, "msa", (crash, ("msa_forward", "msa_backward")))
    with pytest.warns(RuntimeWarning, match="RuntimeError: CUDA error: an illegal memory access"):
        assert _resolve() is dispatch.reference_impl("msa_forward")


def test_a_pass_is_cached_on_disk_per_driver_device_and_artifacts(gpu, tmp_path):
    _resolve()
    files = list((tmp_path / "cache" / "flash-msa" / "guard").glob("*.json"))
    assert len(files) == 1
    record = json.loads(files[0].read_text())
    assert record["identity"]["driver"] == 13000 and record["identity"]["device"] == "NVIDIA B200"
    assert record["identity"]["artifacts"] == artifacts.manifest_digest("sm100a") and "msa/bf16" in record["passed"]
    _new_process()
    assert _resolve() is kernels.KERNELS.ops["msa_forward"]
    assert len(gpu.runs) == 1  # the second process read the pass from disk

    gpu.driver = 13010  # another driver: checked again
    _new_process()
    _resolve()
    assert len(gpu.runs) == 2

    _new_process()
    gpu.monkeypatch.setattr(guard, "device_name_uuid", lambda index: ("NVIDIA B200", "GPU-another"))
    _resolve()
    assert len(gpu.runs) == 3

    _new_process()
    _mark(tmp_path, "sm100a", False)  # same flag, but other cubins: the manifest changes
    path = tmp_path / "sm100a" / "manifest.json"
    m = json.loads(path.read_text())
    name = next(iter(m["variants"]))
    m["variants"][name]["sha256"] = "1" * 64
    path.write_text(json.dumps(m))
    artifacts.load_manifest.cache_clear()
    _resolve()
    assert len(gpu.runs) == 4


def test_the_cache_lives_under_xdg_cache_home_or_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert guard.cache_dir() == tmp_path / "xdg" / "flash-msa"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert guard.cache_dir() == tmp_path / "home" / ".cache" / "flash-msa"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG rule: ignored
    assert guard.cache_dir() == tmp_path / "home" / ".cache" / "flash-msa"


def test_an_unwritable_cache_only_costs_a_recheck(gpu, tmp_path):
    (tmp_path / "cache").write_text("a file where the cache directory would go")
    assert _resolve() is kernels.KERNELS.ops["msa_forward"]
    _new_process()
    _resolve()
    assert len(gpu.runs) == 2


def test_capture_never_runs_a_slice(gpu):
    gpu.capturing = True
    with pytest.raises(guard.GuardCaptureError, match="outside capture first"):
        _resolve()
    assert gpu.runs == []
    gpu.capturing = False
    _resolve()  # one step outside capture
    _new_process()
    gpu.capturing = True  # proven on disk: capture goes ahead without a slice
    assert _resolve() is kernels.KERNELS.ops["msa_forward"]
    assert len(gpu.runs) == 1
    with pytest.raises(guard.GuardCaptureError):  # another family, still unproven
        _resolve("select_blocks", top_k_blocks=16)


def test_off_skips_the_guard(gpu, monkeypatch):
    monkeypatch.setenv(guard.ENV_MODE, "off")
    gpu.verdicts["msa"] = FAIL
    gpu.capturing = True
    assert _resolve() is kernels.KERNELS.ops["msa_forward"]
    assert gpu.runs == []


def test_raise_makes_a_failure_an_error(gpu, monkeypatch):
    monkeypatch.setenv(guard.ENV_MODE, "raise")
    gpu.verdicts["msa"] = FAIL
    with pytest.raises(guard.GuardFailure, match="max error 5.000e[+]00.*python -m flash_msa_rt selftest"):
        _resolve()


def test_an_unknown_mode_names_the_variable(gpu, monkeypatch):
    monkeypatch.setenv(guard.ENV_MODE, "strict")
    with pytest.raises(ValueError, match="FLASH_MSA_GUARD='strict'.*warn, raise, off"):
        _resolve()


@pytest.mark.parametrize("arch, recorded, forced, guarded", [
    ("sm90a", True, "", False),
    ("sm90a", None, "", False),  # a manifest from before the field: sm90a was verified then
    ("sm100a", None, "", True),
    ("sm100a", True, "", False),  # once sm100a is verified on hardware its builds say so
    ("sm90a", True, "sm90a", True),  # the test hook: force-marked unverified
    ("sm90a", True, "sm100a, sm90a", True),
])
def test_verified_archs_never_run_the_guard_unless_force_marked(gpu, tmp_path, catalogue_artifacts, monkeypatch,
                                                                arch, recorded, forced, guarded):
    catalogue_artifacts(arch)
    _mark(tmp_path, arch, recorded)
    monkeypatch.setenv(guard.ENV_UNVERIFIED, forced)
    assert guard.unverified(arch) is guarded
    assert _resolve() is kernels.KERNELS.ops["msa_forward"]
    assert len(gpu.runs) == int(guarded)


def test_suspended_admits_without_a_slice_and_forgets_what_it_resolved(gpu):
    gpu.verdicts["msa"] = FAIL
    with guard.suspended():
        assert _resolve() is kernels.KERNELS.ops["msa_forward"]
    assert gpu.runs == []
    with pytest.warns(RuntimeWarning, match="first-use check"):  # resolved afresh, guarded
        assert _resolve() is dispatch.reference_impl("msa_forward")


def test_families_and_units():
    assert guard.family("select_blocks", {}) == "select"
    assert guard.family("msa_forward", {"deterministic": True}) == "msa"
    assert guard.family("msa_backward", {"deterministic": True}) == "msa_deterministic"
    assert guard.family("warmup_backward", {}) == "warmup"
    assert guard.family("block_sparse_backward", {}) == "block_sparse"
    assert guard.units("sm90a") == ["select/bf16", "msa/bf16", "msa_deterministic/bf16", "warmup/bf16",
                                    "block_sparse/bf16"]
    assert "msa_deterministic/f16" not in guard.units("sm100a", "f16")


def test_each_shape_proves_its_own_cubins(gpu, tmp_path, catalogue_artifacts):
    """A model at D 64 with blocks of 64 launches other cubins than D 128 / Bs 128: its first call runs the slice at
    its own shape, and a failure there sends that shape alone to the reference."""
    catalogue_artifacts("sm100a", (64, 128), (64, 128))
    _mark(tmp_path, "sm100a", False)
    small = slices.Shape(64, 64, 64)
    gpu.verdicts[("msa", small)] = FAIL
    assert _resolve() is kernels.KERNELS.ops["msa_forward"]
    with pytest.warns(RuntimeWarning, match=r"msa kernels \(bf16, D64-Dp64-Bs64\) failed"):
        assert _resolve(head_dim=64, proxy_head_dim=64, block_size=64) is dispatch.reference_impl("msa_forward")
    assert _resolve(head_dim=128, proxy_head_dim=64) is kernels.KERNELS.ops["msa_forward"]
    assert gpu.runs == [("msa", torch.bfloat16), ("msa", torch.bfloat16, small),
                        ("msa", torch.bfloat16, slices.Shape(128, 64, 128))]
    _new_process()  # the passes are on disk under their own names; the failure is not
    assert _resolve() is kernels.KERNELS.ops["msa_forward"]
    assert _resolve(head_dim=128, proxy_head_dim=64) is kernels.KERNELS.ops["msa_forward"]
    assert len(gpu.runs) == 3
    passed = json.loads(next((tmp_path / "cache" / "flash-msa" / "guard").glob("*.json")).read_text())["passed"]
    assert sorted(passed) == ["msa/bf16", "msa/bf16/D128-Dp64-Bs128"]


def test_a_units_shape_is_what_its_cubins_depend_on():
    S = slices.Shape
    msa = dict(MSA, head_dim=256, proxy_head_dim=128, block_size=64)
    assert guard.shape_of("msa_forward", msa) == S(256, 128, 64)
    assert guard.shape_of("select_blocks", {"proxy_head_dim": 64, "block_size": 64}) == S(64, 64, 64)
    assert guard.shape_of("warmup_forward", dict(msa, block_size=None)) == S(256, 128, 128)
    assert guard.shape_of("block_sparse_forward", {"head_dim": 64, "block_size": 64}) == S(64, 64, 64)
    assert guard.shape_of("block_sparse_forward", {"head_dim": 256, "block_size": 128}) == S(256, 128, 128)
    assert guard.unit_name("msa", "bf16", S()) == "msa/bf16"  # the default keeps the name passes were saved under
    assert guard.unit_name("msa", "f16", S(256, 128, 64)) == "msa/f16/D256-Dp128-Bs64"
    assert guard.split_unit("msa/f16/D256-Dp128-Bs64") == ("msa", "f16", S(256, 128, 64))
    assert guard.split_unit("select/bf16") == ("select", "bf16", S())
    assert guard.units("sm90a", "bf16", S(64, 64, 64))[0] == "select/bf16/D64-Dp64-Bs64"
    with pytest.raises(ValueError, match="'D64-Bs64': expected D<d>-Dp<dp>-Bs<bs>"):
        S.parse("D64-Bs64")


# --- the real slices, on the reference's ops (CPU): they pass it, and catch a wrong kernel -----------------------

@pytest.mark.parametrize("shape", [slices.Shape(), slices.Shape(64, 64, 64), slices.Shape(256, 128, 128),
                                   slices.Shape(128, 64, 64)], ids=lambda s: s.suffix() or "default")
@pytest.mark.parametrize("family", ["select", "msa", "warmup", "block_sparse"])
def test_the_slices_pass_the_reference(family, shape):
    ops = dispatch.backends()[-1].ops  # the reference backend
    fn = slices.SLICES[family][0]
    comps = fn(ops, torch.bfloat16, torch.device("cpu"), shape)
    assert comps and all(c.ok for c in comps), [str(c) for c in comps]
    if family != "select":  # the reference in bfloat16 is not exact: the bounds are live, not vacuous
        assert any(c.max_error > 0 for c in comps)


@pytest.mark.parametrize("family, op, output", [
    ("msa", "msa_forward", 0),
    ("msa", "msa_backward", 2),
    ("warmup", "warmup_backward", 4),
    ("block_sparse", "block_sparse_forward", 1),
])
def test_the_slices_catch_a_wrong_kernel(family, op, output):
    ops = dict(dispatch.backends()[-1].ops)
    right = ops[op]

    def wrong(*args):
        outs = list(right(*args))
        outs[output] = outs[output] * 1.05 + 0.01
        return tuple(outs)

    ops[op] = wrong
    for shape in (slices.Shape(), slices.Shape(64, 64, 64)):
        comps = slices.SLICES[family][0](ops, torch.bfloat16, torch.device("cpu"), shape)
        assert any(not c.ok for c in comps), [str(c) for c in comps]


def test_a_wrong_selection_fails_the_select_slice():
    ops = dict(dispatch.backends()[-1].ops)
    right = ops["select_blocks"]
    ops["select_blocks"] = lambda *a: right(*a).flip(-1).roll(1, dims=2)
    assert not all(c.ok for c in slices.select_slice(ops, torch.bfloat16, torch.device("cpu")))


# --- the manifest field -----------------------------------------------------------------------------------------

def test_the_manifest_records_hardware_verification():
    m = Manifest("sm100a", {"cutlass_dsl": "x"}, {}, hardware_verified=False)
    assert json.loads(m.dumps())["hardware_verified"] is False
    assert Manifest.from_json(json.loads(m.dumps())).hardware_verified is False
    old = {"schema": 1, "arch": "sm90a", "fingerprint": {}, "variants": {}}
    assert Manifest.from_json(old).hardware_verified is None
    assert "hardware_verified" not in Manifest.from_json(old).to_json()
    with pytest.raises(ManifestError, match="hardware_verified"):
        Manifest.from_json(dict(old, hardware_verified="yes"))


def test_the_build_writes_the_field_from_its_list(tmp_path):
    from build_tools import build

    assert build.HARDWARE_VERIFIED_ARCHS == {"sm90a"}
    fp = {"cutlass_dsl": "4.8.1", "kernels_src_sha256": "0"}
    assert build.load_manifest(tmp_path / "sm90a", "sm90a", fp).hardware_verified is True
    for arch in ("sm100a", "sm100f"):
        assert build.load_manifest(tmp_path / arch, arch, fp).hardware_verified is False


def test_the_slices_never_dispatch(monkeypatch):
    """The guard runs while dispatch resolves an op (inside the torch.library op, below autograd): its slices call
    the backend's ops directly, so they cannot recurse into dispatch or the guard."""
    def no_dispatch(*args, **kwargs):
        raise AssertionError("a slice dispatched")

    monkeypatch.setattr(dispatch, "implementation", no_dispatch)
    monkeypatch.setattr(guard, "admit", no_dispatch)
    ops = dispatch.backends()[-1].ops
    for family in ("select", "msa", "block_sparse"):
        assert all(c.ok for c in slices.SLICES[family][0](ops, torch.float16, torch.device("cpu")))


def test_info_says_which_archs_are_unverified(tmp_path, catalogue_artifacts, capsys):
    from flash_msa_rt.__main__ import describe_artifacts

    catalogue_artifacts("sm90a")
    catalogue_artifacts("sm100a")
    _mark(tmp_path, "sm90a", True)
    _mark(tmp_path, "sm100a", False)
    describe_artifacts(verbose=False)
    out = capsys.readouterr().out
    assert "not verified on sm100a hardware" in out and "not verified on sm90a" not in out
