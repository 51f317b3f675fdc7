"""Distributions (issue 41) and the source build's choices (issue 39): per-arch wheels that an index accepts and
that install side by side, the meta-package's extras, the runtime's device checks and driver messages, the arch
a `pip install .` compiles, incremental rebuilds, and the check that wheels ship cubins of the right arch only.

The build tests compile one tiny variant per arch (block_scores d64, as CI does) with one job.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from build_tools import wheel_archs, wheel_check
from flash_msa_rt import arch as arches
from flash_msa_rt import artifacts, driver
from flash_msa_rt.errors import LaunchError, MissingVariantError

try:
    import tomllib
except ImportError:
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
TINY = "block_scores_bf16_d64_b128_*"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def fake_cubin(sm: int, body: bytes = b"") -> bytes:
    """An ELF header as CUDA 12.8+ writes it for a cubin: class 64, OS ABI 0x41, ABI version 8, EM_CUDA, the SM
    in e_flags bits 8-15."""
    head = bytearray(64)
    head[:4] = b"\x7fELF"
    head[4], head[5], head[7], head[8] = 2, 1, 0x41, 8
    struct.pack_into("<H", head, 18, 190)
    struct.pack_into("<I", head, 48, 0x06000000 | (sm << 8) | 0x04)
    return bytes(head) + body


# -- names, tables, metadata -------------------------------------------------------------------------------------

def test_arch_tables_agree():
    from kernels_src.spec import ARCHS

    assert tuple(arches.RUNS_ON) == tuple(ARCHS) == wheel_archs.ARCHS
    assert set(wheel_check.ARCH_SM) == set(ARCHS)


def test_distribution_names_and_extras():
    project = PYPROJECT["project"]
    assert project["name"] == arches.RUNTIME_DIST == "flash-msa-rt"  # "flash-msa" on PyPI is another project
    entries = {e["field"]: e for e in PYPROJECT["tool"]["dynamic-metadata"]}
    extras = entries["optional-dependencies"]["result"]
    for arch in arches.RUNS_ON:
        assert extras[arch] == [f"flash-msa-rt-{arch}=={{project[version]}}"]
    assert sorted(extras["all"]) == sorted(f"flash-msa-rt-{a}=={{project[version]}}" for a in arches.RUNS_ON)
    assert entries["version"]["input"] == "flash_msa_rt/__init__.py"
    # the compiler pin is one version everywhere: build requirement, test extra
    pins = {r for r in PYPROJECT["tool"]["flash-msa"]["kernel-build-requires"] if r.startswith("nvidia-cutlass-dsl")}
    assert len(pins) == 1 and pins <= set(extras["test"])
    # the MiniMax-M3 integration's extra, and the test extra runs its tests (never a runtime requirement)
    assert extras["transformers"] == ["transformers>=5.23"] and set(extras["transformers"]) <= set(extras["test"])
    assert not [r for r in project["dependencies"] if r.startswith("transformers")]


def test_pyproject_is_reproducible_and_pure():
    sk = PYPROJECT["tool"]["scikit-build"]
    assert sk["wheel"]["reproducible"] is True and sk["sdist"]["reproducible"] is True
    assert sk["wheel"]["py-api"] == "py3" and sk["wheel"]["platlib"] is False


def test_arch_pyproject_names_its_arch_and_pins_the_runtime():
    from build_tools import release

    text = release.arch_pyproject("sm100f", PYPROJECT)
    data = tomllib.loads(text)
    version = release.project_version()
    assert data["project"]["name"] == "flash-msa-rt-sm100f" and data["project"]["version"] == version
    assert "+" not in version  # no local version label: an index refuses one
    assert data["project"]["dependencies"] == [f"flash-msa-rt=={version}"]
    assert data["tool"]["flash-msa"]["archs"] == "sm100f"
    assert data["tool"]["scikit-build"]["wheel"]["packages"] == []
    (override,) = data["tool"]["scikit-build"]["overrides"]
    assert override["wheel"]["tags"] == ["py3-none-manylinux_2_28_x86_64", "py3-none-manylinux_2_28_aarch64"]


# -- which archs a source build compiles --------------------------------------------------------------------------

def _project(tmp_path, archs=None):
    text = '[project]\nname = "x"\n' + (f'[tool.flash-msa]\narchs = "{archs}"\n' if archs else "")
    (tmp_path / "pyproject.toml").write_text(text)
    return tmp_path


def test_no_gpu_builds_no_kernels_and_says_so(tmp_path):
    archs, why = wheel_archs.resolve(_project(tmp_path), environ={}, gpus=[])
    assert archs == []
    assert "no NVIDIA GPU found" in why and "without kernels" in why and "FLASH_MSA_ARCHS=sm90a" in why


def test_gpus_pick_their_archs(tmp_path):
    gpus = [("NVIDIA H200", 9, 0), ("NVIDIA B300", 10, 3), ("NVIDIA B200", 10, 0), ("NVIDIA A100", 8, 0)]
    archs, why = wheel_archs.resolve(_project(tmp_path), environ={"FLASH_MSA_ARCHS": "auto"}, gpus=gpus)
    assert archs == ["sm90a", "sm100f", "sm100a"]
    assert "NVIDIA H200 (compute capability 9.0) -> sm90a" in why and "A100 has compute capability 8.0" in why
    archs, why = wheel_archs.resolve(_project(tmp_path), environ={}, gpus=[("NVIDIA A100", 8, 0)])
    assert archs == [] and "no supported NVIDIA GPU" in why


def test_environment_and_fixed_archs(tmp_path):
    p = _project(tmp_path)
    assert wheel_archs.resolve(p, environ={"FLASH_MSA_ARCHS": "sm90a,sm100a"}, gpus=[])[0] == ["sm90a", "sm100a"]
    assert wheel_archs.resolve(p, environ={"FLASH_MSA_ARCHS": "none"}, gpus=[("H200", 9, 0)])[0] == []
    with pytest.raises(wheel_archs.ArchChoiceError, match=r"'sm80' is not an arch.*sm90a, sm100a, sm100f"):
        wheel_archs.resolve(p, environ={"FLASH_MSA_ARCHS": "sm80"})
    # a per-arch distribution builds its own arch whatever the environment says
    (tmp_path / "arch").mkdir()
    fixed = _project(tmp_path / "arch", "sm100a")
    archs, why = wheel_archs.resolve(fixed, environ={"FLASH_MSA_ARCHS": "sm90a"}, gpus=[])
    assert archs == ["sm100a"] and "ignored" in why


def test_backend_asks_for_the_compiler_only_when_compiling(monkeypatch):
    from build_tools import backend  # imports scikit-build-core: a [test] requirement, imported only here

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(backend._skbuild, "get_requires_for_build_wheel", lambda cs=None: ["cmake>=3.18"])
    monkeypatch.setenv("FLASH_MSA_ARCHS", "none")
    assert backend.get_requires_for_build_wheel() == ["cmake>=3.18"]
    monkeypatch.setenv("FLASH_MSA_ARCHS", "sm90a")
    reqs = backend.get_requires_for_build_wheel()
    assert reqs[0] == "cmake>=3.18" and any(r.startswith("nvidia-cutlass-dsl[cu13]==") for r in reqs)


# -- the runtime's device checks ----------------------------------------------------------------------------------

def _arch_root(tmp_path, archs):
    for a in archs:
        (tmp_path / a).mkdir(parents=True)
        (tmp_path / a / "manifest.json").write_text(json.dumps(
            {"schema": 1, "arch": a, "fingerprint": {"cutlass_dsl": "4.8.1"}, "variants": {}}))
    return tmp_path


def test_device_mismatch_names_gpu_capability_installed_and_package():
    msg = arches.device_mismatch("NVIDIA H200", 9, 0, ["sm100a"], "/site/flash_msa_rt/_artifacts")
    assert "NVIDIA H200 has compute capability 9.0" in msg and "sm100a (runs on 10.0 only)" in msg
    assert 'pip install "flash-msa-rt[sm90a]"' in msg and "flash-msa-rt-sm90a" in msg
    assert arches.device_mismatch("NVIDIA B200", 10, 0, ["sm100f"], "x") is None  # the family build runs on 10.0
    msg = arches.device_mismatch("NVIDIA B300", 10, 3, ["sm100a"], "x")  # sm_100a SASS does not run on 10.3
    assert "10.3" in msg and "flash-msa-rt[sm100f]" in msg
    assert "8.0" in arches.device_mismatch("NVIDIA A100", 8, 0, ["sm90a"], "x")


def test_every_device_is_checked(tmp_path, artifact_dir_env, monkeypatch):
    artifact_dir_env(_arch_root(tmp_path, ["sm90a", "sm100a"]))
    devices = [(0, "NVIDIA H200", 9, 0), (1, "NVIDIA B200", 10, 0), (2, "NVIDIA B300", 10, 3)]
    problems = artifacts.device_problems(devices)
    assert len(problems) == 1 and "NVIDIA B300 (cuda:2) has compute capability 10.3" in problems[0]
    assert "sm100a (runs on 10.0 only), sm90a (runs on 9.0 only)" in problems[0]
    monkeypatch.setattr(artifacts, "_torch_devices", lambda: devices)
    with pytest.raises(MissingVariantError, match=r"flash-msa-rt\[sm100f\]"):
        artifacts.check_devices()


def test_missing_arch_names_the_package_and_the_devices(tmp_path, artifact_dir_env, monkeypatch):
    artifact_dir_env(_arch_root(tmp_path, ["sm100a"]))
    monkeypatch.setattr(artifacts, "_torch_devices", lambda: [(0, "NVIDIA H200", 9, 0)])
    with pytest.raises(MissingVariantError) as e:
        artifacts.load_manifest(tmp_path, "sm90a")
    text = str(e.value)
    assert "archs installed there: sm100a" in text and "NVIDIA H200 (cuda:0, compute capability 9.0)" in text
    assert 'pip install "flash-msa-rt[sm90a]"' in text and "python -m build_tools build" in text


def test_runtime_alone_names_the_package_this_gpu_needs(tmp_path, artifact_dir_env, monkeypatch):
    artifact_dir_env(tmp_path / "empty")
    monkeypatch.setattr(arches, "visible_gpus", lambda: [("NVIDIA H200", 9, 0)])
    notice = artifacts.import_notice()
    assert "carries no kernels" in notice and 'pip install "flash-msa-rt[sm90a]"' in notice
    monkeypatch.setattr(arches, "visible_gpus", lambda: [])
    assert artifacts.import_notice() is None  # no GPU: the reference runs, and says so itself
    artifact_dir_env(_arch_root(tmp_path / "full", ["sm90a"]))
    monkeypatch.setattr(arches, "visible_gpus", lambda: pytest.fail("asked the driver although cubins are installed"))
    assert artifacts.import_notice() is None


def test_visible_gpus_without_a_driver_is_empty(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert arches.visible_gpus() == []


# -- driver refusals become clear messages --------------------------------------------------------------------------

def test_driver_refusals_name_the_cause():
    old = driver.load_error_message("CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "12.8", "NVIDIA H200", (9, 0))
    assert "driver is too old (it supports CUDA 12.8)" in old and "CUDA 13 (R580)" in old
    stale = driver.load_error_message("CUDA_ERROR_INVALID_IMAGE", "12.4", "NVIDIA H200", (9, 0))
    assert "too old" in stale
    invalid = driver.load_error_message("CUDA_ERROR_INVALID_IMAGE", "13.0", "NVIDIA H200", (9, 0))
    assert "cannot read this cubin image" in invalid and "reinstall" in invalid
    nobin = driver.load_error_message("CUDA_ERROR_NO_BINARY_FOR_GPU", "13.0", "NVIDIA B300 (compute capability 10.3)",
                                      (10, 3))
    assert "cannot run this cubin" in nobin and "sm100a on 10.0 only" in nobin and "flash-msa-rt[sm100f]" in nobin


def test_load_library_reports_through_the_message(monkeypatch):
    class FakeCu:
        class CUdevice_attribute:
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76

        def cuLibraryLoadData(self, *a):
            return (209, None)

        def cuGetErrorName(self, err):
            return (0, b"CUDA_ERROR_NO_BINARY_FOR_GPU")

        def cuDriverGetVersion(self):
            return (0, 13000)

        def cuCtxGetDevice(self):
            return (0, 0)

        def cuDeviceGetName(self, n, dev):
            return (0, b"NVIDIA H200\0\0")

        def cuDeviceGetAttribute(self, attr, dev):
            return (0, 9 if attr == 75 else 0)

    monkeypatch.setattr(driver, "cu", lambda: FakeCu())
    monkeypatch.setattr(driver, "driver_version", lambda: 13000)
    with pytest.raises(LaunchError, match=r"NVIDIA H200 \(compute capability 9.0\) cannot run.*flash-msa-rt\[sm90a\]"):
        driver.load_library(b"x")


# -- what a wheel may ship -----------------------------------------------------------------------------------------

def _tree(arch, cubins: dict[str, bytes], listed=None):
    root = "flash_msa_rt/_artifacts/" + arch
    variants = {}
    for name, data in cubins.items():
        variants[name] = {"arch": arch, "cubin": f"{name}.cubin", "sha256": hashlib.sha256(data).hexdigest()}
    files = {f"{root}/{n}.cubin": d for n, d in cubins.items() if listed is None or n in listed}
    files[f"{root}/manifest.json"] = json.dumps({"arch": arch, "variants": variants}).encode()
    return files


def test_wheel_check_accepts_matching_cubins_and_rejects_the_rest():
    good = _tree("sm90a", {"k_sm90a": fake_cubin(90)}) | _tree("sm100f", {"k_sm100f": fake_cubin(100)})
    assert wheel_check.check_files(good) == []
    wrong_sm = _tree("sm90a", {"k_sm90a": fake_cubin(100)})
    assert any("cubin for SM 100 in the sm90a folder" in p for p in wheel_check.check_files(wrong_sm))
    ptx = dict(good, **{"flash_msa_rt/_artifacts/sm90a/ptx/k_sm90a.ptx": b".target sm_90a"})
    assert any("PTX is shipped" in p for p in wheel_check.check_files(ptx))
    extra = dict(good, **{"flash_msa_rt/_artifacts/sm90a/stray.cubin": fake_cubin(90)})
    assert any("stray.cubin: not listed" in p for p in wheel_check.check_files(extra))
    missing = _tree("sm90a", {"k_sm90a": fake_cubin(90)}, listed=[])
    assert any("listed in the manifest but missing" in p for p in wheel_check.check_files(missing))
    corrupt = _tree("sm90a", {"k_sm90a": fake_cubin(90)})
    corrupt["flash_msa_rt/_artifacts/sm90a/k_sm90a.cubin"] += b"!"
    assert any("sha256 differs" in p for p in wheel_check.check_files(corrupt))
    assert wheel_check.cubin_sm(b"not an elf at all, not an elf at all, not an elf at all") is None


def test_release_frontend_not_shadowed(tmp_path, monkeypatch):
    """`python -m build` from the checkout must reach the PyPA frontend: the kernel cache and the release's work
    folder are not build/ (which Python takes for a namespace package named build), and without the frontend the
    release says what to install instead of "No module named build.__main__"."""
    from build_tools import release

    text = Path(release.__file__).read_text() + (REPO / "CMakeLists.txt").read_text()
    assert '"build" / "' not in text and "/build/kernel-cache" not in text
    (tmp_path / "build").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    real = importlib.util.find_spec

    def without_frontend(name, *a):
        if name.split(".")[0] == "build":
            spec = importlib.machinery.ModuleSpec("build", None, is_package=True)
            return None if name != "build" else spec
        return real(name, *a)
    monkeypatch.setattr(importlib.util, "find_spec", without_frontend)
    with pytest.raises(SystemExit, match="pip install build"):
        release.require_frontend()


# -- real builds (one tiny variant per arch) -------------------------------------------------------------------------

def snapshot(dest: Path) -> Path:
    """A copy of the source tree as a release would see it (no build outputs, no VCS), so concurrent edits or a
    local build cache cannot leak into a test build."""
    ignore = shutil.ignore_patterns(".git", "build", ".kernel-cache", ".release-work", "dist", "artifacts", "artifacts_*", ".ci-venv", ".venv",
                                    "__pycache__", "runs", "*.egg-info", "wheelhouse", ".whl")
    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


def run(cmd, cwd, env_extra=None, timeout=900):
    env = dict(os.environ, **(env_extra or {}))
    for var in ("FLASH_MSA_ARCHS", "FLASH_MSA_BUILD_ONLY", "FLASH_MSA_ARTIFACT_DIR", "FLASH_MSA_BUILD_CACHE"):
        if var not in (env_extra or {}):
            env.pop(var, None)
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return r


def release(src: Path, out: Path, archs: str, cache: Path) -> dict[str, str]:
    r = run([sys.executable, "-m", "build_tools.release", "--out", str(out), "--arch", archs, "--only", TINY,
             "-j", "1", "--no-isolation", "--cache", str(cache), "--work", str(out.parent / "work")], cwd=src,
            env_extra={"SOURCE_DATE_EPOCH": "1767225600"})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    sums = dict(line.split("  ")[::-1] for line in (out / "SHA256SUMS").read_text().splitlines())
    assert "twine upload" in r.stdout
    return sums


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    base = tmp_path_factory.mktemp("release")
    src = snapshot(base / "src")
    sums = release(src, base / "dist", "sm90a,sm100a", base / "cache")
    return base / "dist", sums


def test_release_builds_index_ready_distributions(released):
    out, sums = released
    from build_tools.release import check_dist, project_version

    version = project_version()
    tag = "py3-none-manylinux_2_28_aarch64.manylinux_2_28_x86_64"
    assert sorted(sums) == sorted([f"flash_msa_rt-{version}.tar.gz", f"flash_msa_rt-{version}-py3-none-any.whl",
                                   f"flash_msa_rt_sm90a-{version}-{tag}.whl", f"flash_msa_rt_sm100a-{version}-{tag}.whl"])
    for name, digest in sums.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    runtime = out / f"flash_msa_rt-{version}-py3-none-any.whl"
    assert check_dist(runtime, None) == []
    with zipfile.ZipFile(runtime) as z:
        meta = z.read(f"flash_msa_rt-{version}.dist-info/METADATA").decode()
    assert "Name: flash-msa-rt\n" in meta and f'flash-msa-rt-sm90a=={version}; extra == "sm90a"' in meta
    assert f'flash-msa-rt-sm100f=={version}; extra == "all"' in meta
    for arch in ("sm90a", "sm100a"):
        wheel = out / f"flash_msa_rt_{arch}-{version}-{tag}.whl"
        assert check_dist(wheel, arch) == []  # only its arch's manifest + cubins, SM matching, no PTX
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(f"flash_msa_rt_{arch}-{version}.dist-info/METADATA").decode()
            names = z.namelist()
            wheel_meta = z.read(f"flash_msa_rt_{arch}-{version}.dist-info/WHEEL").decode()
        assert f"Name: flash-msa-rt-{arch}\n" in meta and f"Requires-Dist: flash-msa-rt=={version}" in meta
        assert "Root-Is-Purelib: true" in wheel_meta  # beside the runtime even where purelib != platlib
        assert any(n.endswith(".cubin") for n in names) and not any(n.endswith(".ptx") for n in names)


def _pip(*args, cwd):
    return run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], cwd=cwd)


def test_per_arch_wheels_install_side_by_side_and_the_runtime_picks_per_device(released, tmp_path):
    out, sums = released
    target = tmp_path / "site"
    r = _pip("install", "--no-index", "--no-deps", "--target", str(target), *[str(out / n) for n in sums
                                                                                if n.endswith(".whl")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    probe = (
        "import json; from flash_msa_rt import artifacts, arch\n"
        "root = artifacts.artifact_root(); have = artifacts.carried_archs()\n"
        "for a in have: artifacts.load_manifest(root, a)\n"
        "print(json.dumps({'root': str(root), 'have': have,\n"
        "  'pick': {f'{M}.{m}': arch.arch_for_capability(M, m, have) for M, m in ((9, 0), (10, 0))},\n"
        "  'problems': artifacts.device_problems([(0, 'H200', 9, 0), (1, 'B200', 10, 0), (2, 'B300', 10, 3)])}))\n")
    r = run([sys.executable, "-c", probe], cwd=tmp_path, env_extra={"PYTHONPATH": str(target)})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["root"].startswith(str(target)) and got["have"] == ["sm100a", "sm90a"]
    assert got["pick"] == {"9.0": "sm90a", "10.0": "sm100a"}
    (problem,) = got["problems"]  # only the 10.3 part lacks a package: sm100f
    assert "B300 (cuda:2) has compute capability 10.3" in problem and "flash-msa-rt[sm100f]" in problem


def test_pip_refuses_per_arch_wheels_off_linux(released, tmp_path):
    out, sums = released
    wheel = str(out / next(n for n in sums if n.startswith("flash_msa_rt_sm90a")))
    common = ["install", "--dry-run", "--no-index", "--no-deps", "--only-binary=:all:", "--target", str(tmp_path / "t")]
    for platform in ("macosx_11_0_arm64", "win_amd64"):
        r = _pip(*common, "--platform", platform, wheel, cwd=tmp_path)
        assert r.returncode != 0 and "is not a supported wheel on this platform" in r.stderr + r.stdout
    for platform in ("manylinux_2_28_x86_64", "manylinux_2_28_aarch64"):
        r = _pip(*common, "--platform", platform, wheel, cwd=tmp_path)
        assert r.returncode == 0, r.stderr


def _wheel(src: Path, out: Path, env: dict) -> subprocess.CompletedProcess:
    r = run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(out), str(src)], cwd=src,
            env_extra=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def test_source_build_is_incremental_and_ships_only_the_selection(tmp_path):
    src = snapshot(tmp_path / "src")
    cache = tmp_path / "cache"
    env = {"FLASH_MSA_ARCHS": "sm90a", "FLASH_MSA_BUILD_ONLY": TINY, "FLASH_MSA_BUILD_JOBS": "1",
           "FLASH_MSA_BUILD_CACHE": str(cache)}
    first = _wheel(src, tmp_path / "w1", env)
    (wheel,) = (tmp_path / "w1").glob("*.whl")
    selected = sorted(Path(n).name for n in wheel_check.wheel_files(wheel) if n.endswith(".cubin"))
    n = len(selected)
    assert n >= 1 and all(c.startswith(TINY[:-1]) and c.endswith("_sm90a.cubin") for c in selected)
    log = first.stdout + first.stderr
    assert "flash-msa: building kernels for sm90a (FLASH_MSA_ARCHS)" in log
    assert f"compiling {n} variants" in log and f"[{n}/{n}]" in log  # a line before, and one per variant
    second = _wheel(src, tmp_path / "w2", env)
    log = second.stdout + second.stderr
    assert "nothing to compile: every variant is up to date" in log and f"0 built, {n} up to date" in log
    # the cache holds more than this build asks for; the wheel carries only the selection
    other = "block_scores_bf16_d128_b128_*"
    r = run([sys.executable, "-m", "build_tools", "build", "--arch", "sm90a", "--only", other, "-j", "1",
             "--out", str(cache)], cwd=src)
    assert r.returncode == 0, r.stderr
    assert len(list((cache / "sm90a").glob("*.cubin"))) > n
    _wheel(src, tmp_path / "w3", env)
    (wheel,) = (tmp_path / "w3").glob("*.whl")
    files = wheel_check.wheel_files(wheel)
    assert wheel_check.check_files(files) == []
    assert sorted(Path(n).name for n in files if n.endswith(".cubin")) == selected


def test_runtime_only_build_compiles_nothing(tmp_path):
    src = snapshot(tmp_path / "src")
    r = _wheel(src, tmp_path / "w", {"FLASH_MSA_ARCHS": "none"})
    assert "building the runtime without kernels" in r.stdout + r.stderr
    (wheel,) = (tmp_path / "w").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    assert not [n for n in wheel_check.wheel_files(wheel) if "_artifacts" in n]


def test_first_op_import_warns_once_with_the_notice(monkeypatch):
    import flash_msa_rt

    monkeypatch.setattr(flash_msa_rt, "_noticed", False)
    monkeypatch.setattr(artifacts, "import_notice", lambda: "install flash-msa-rt[sm90a]")
    with pytest.warns(UserWarning, match=r"flash-msa-rt\[sm90a\]"):
        flash_msa_rt.__getattr__("select_blocks")
    monkeypatch.setattr(artifacts, "import_notice", lambda: pytest.fail("noticed twice"))
    flash_msa_rt.__getattr__("select_blocks")


def test_readme_install_commands_match_the_build():
    """The main-job command builds for the machine's GPU (none without one: no FLASH_MSA_ARCHS), shows build
    progress (-v) and installs torch's CPU build where there is no GPU; the test command is the one CI runs."""
    import re

    readme = (REPO / "README.md").read_text()
    section = readme.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    main, tests = re.findall(r"```bash\n(.*?)```", section, re.S)[:2]
    assert "pip install -v ." in main and "FLASH_MSA_ARCHS" not in main
    assert "--index-url https://download.pytorch.org/whl/cpu" in main and "nvidia-smi" in main
    for cmd in (main, tests):  # as .ci/run: the CPU index without retries, else PyPI
        assert "--retries 0 torch" in cmd and "|| pip install torch" in cmd
    ci = (REPO / ".ci" / "run").read_text()
    only = re.search(r'FLASH_MSA_BUILD_ONLY="([^"]+)"', tests).group(1)
    assert f'FLASH_MSA_BUILD_ONLY="{only}"' in ci and only == TINY
    assert 'pip install -v ".[test]"' in tests and 'pip install -v ".[test]"' in ci
    install = (REPO / "docs" / "building.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert 'pip install "flash-msa-rt[sm90a]"' in install and 'pip install "flash-msa-rt[sm100a]"' in install
