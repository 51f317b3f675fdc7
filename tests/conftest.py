"""Shared fixtures. GPU tests carry the `gpu` marker and are skipped (with the reason) where no GPU is usable, or
fail instead under FLASH_MSA_REQUIRE_GPU=1 (the GPU run: artifacts missing or a device error must not pass as a
run of skips). In GPU tests a fallback to the pure-PyTorch reference is an error unless the test is marked
`allow_reference` (tests/routing.py)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # build_tools and kernels_src are build-time packages, not installed
    sys.path.insert(0, str(REPO))


REQUIRE_GPU = "FLASH_MSA_REQUIRE_GPU"  # =1: a GPU run that cannot run its GPU tests fails instead of skipping


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    from flash_msa_rt import artifacts
    from flash_msa_rt.errors import FlashMsaError
    from flash_msa_rt.loader import device_arch

    try:
        arch = device_arch(torch.cuda.current_device())
    except FlashMsaError as e:
        return str(e)
    except RuntimeError as e:  # the device errors (driver, busy or lost GPU)
        return f"the CUDA device errors: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if arch not in artifacts.carried_archs():
        return f"no {arch} artifacts under {artifacts.artifact_root()} (set FLASH_MSA_ARTIFACT_DIR)"
    return None


def gpu_required() -> bool:
    return os.environ.get(REQUIRE_GPU, "").strip() not in ("", "0")


_GPU_UNUSABLE = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items):
    from tests import routing

    gpu_items = [i for i in items if "gpu" in i.keywords]
    if not gpu_items:
        return
    for item in gpu_items:  # a silent fallback to the reference would compare the reference with itself
        if "allow_reference" not in item.keywords:
            item.add_marker(pytest.mark.filterwarnings(routing.FALLBACK_FILTER))
    reason = _gpu_skip_reason()
    if not reason:
        return
    if gpu_required():  # each GPU test fails at setup, naming why (pytest_runtest_setup)
        config.stash[_GPU_UNUSABLE] = reason
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line for the GPU tests skipped because no GPU is usable (each is skipped with the same reason), and one
    for the other skips, instead of a line per test (pass -rs to list them)."""
    skipped = terminalreporter.stats.get("skipped", [])
    gpu = [r for r in skipped if "gpu" in getattr(r, "keywords", {})]
    other = len(skipped) - len(gpu)
    if gpu:
        reasons = {r.longrepr[2].removeprefix("Skipped: ") for r in gpu if isinstance(r.longrepr, tuple)}
        if all(why.startswith("GPU test: ") for why in reasons):  # no GPU usable: one reason, one line
            terminalreporter.write_line(f"{len(gpu)} GPU tests skipped ({', '.join(sorted(reasons))}); "
                                        f"FLASH_MSA_REQUIRE_GPU=1 makes that a failure, -rs lists them")
        else:  # a GPU ran them: each skip is a test's own (a route this build or machine lacks)
            terminalreporter.write_line(f"{len(gpu)} GPU tests skipped for their own reasons (-rs lists them), e.g. "
                                        f"{sorted(reasons)[0][:100]}")
    if other:
        terminalreporter.write_line(f"{other} other test{'s' if other != 1 else ''} skipped (-rs lists them)")


def pytest_runtest_setup(item):
    reason = item.config.stash.get(_GPU_UNUSABLE, None)
    if reason and "gpu" in item.keywords:
        pytest.fail(f"{REQUIRE_GPU}=1 but this GPU test cannot run: {reason}", pytrace=False)


@pytest.fixture
def artifact_dir_env(monkeypatch):
    """Point the runtime at a folder for one test and forget cached manifests around it."""
    from flash_msa_rt import artifacts, loader

    def use(path: Path):
        monkeypatch.setenv(artifacts.ENV_ARTIFACT_DIR, str(path))
        artifacts.load_manifest.cache_clear()
        loader._by_request.clear()
        loader._kernels.clear()

    yield use
    artifacts.load_manifest.cache_clear()
    loader._by_request.clear()
    loader._kernels.clear()


@pytest.fixture(autouse=True)
def _fresh_warnings(request):
    """Every test starts with the runtime's once-per-process warnings re-armed and dispatch's record empty
    (issue 40: which test sees a warning must not depend on their order). GPU tests: at teardown that record must
    show no op resolved to the reference on CUDA (the fallback warning is an error there too; this also catches a
    fallback whose exception something swallowed), unless the test is marked allow_reference."""
    from flash_msa_rt.ops import dispatch

    dispatch.reset_warnings()
    yield
    try:
        node = request.node
        if "gpu" in node.keywords and "allow_reference" not in node.keywords:
            from tests import routing

            fallen = routing.reference_fallbacks()
            assert not fallen, (f"ran on the pure-PyTorch reference instead of the kernels: {fallen} (mark the test "
                                f"allow_reference, or use tests.routing.allowed_reference, where it asks for that)")
    finally:
        dispatch.reset_warnings()


@pytest.fixture
def tuned():
    """tuned(policy={field: value, ...}, ...): flash_msa_rt.tuning.override for the rest of the test."""
    from flash_msa_rt import tuning

    with contextlib.ExitStack() as stack:
        yield lambda **ops: stack.enter_context(tuning.override(**ops))


@pytest.fixture
def launched_kernels(monkeypatch):
    """A list that receives the variant name of every kernel the loader launches for the rest of the test."""
    from flash_msa_rt import loader

    names = []
    call = loader.Kernel.__call__

    def recorded(self, *args, **kwargs):
        names.append(self.entry.name)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(loader.Kernel, "__call__", recorded)
    return names


@pytest.fixture
def force_mma(tuned):
    """force_mma(kind): every kernel family runs on that MMA ("sync" or "wgmma") for the test, so both builds are
    checked whatever the runtime picks; wgmma skips off sm90a."""
    def force(mma: str) -> None:
        from flash_msa_rt import tuning
        from flash_msa_rt.loader import device_arch

        if mma == "wgmma" and device_arch(0) != "sm90a":
            pytest.skip("wgmma is sm90a only")
        tuned(**tuning.every_mma(mma))

    return force


@pytest.fixture
def catalogue_artifacts(tmp_path, artifact_dir_env, monkeypatch):
    """catalogue_artifacts(arch[, head_dims, block_sizes]): the runtime sees arch's default build, or the build of
    those configurations (a manifest of kernels_src.catalogue's variants, no cubins) on a device of that arch: what
    dispatch decides from what was built, on CPU."""
    def use(arch: str, head_dims=None, block_sizes=None) -> None:
        from flash_msa_rt import loader
        from flash_msa_rt.manifest import Manifest, source_hash
        from kernels_src.catalogue import variants

        def fingerprint(op):  # stamped with the sources beside us, as a fresh build is
            family = REPO / "kernels_src" / op
            return f"cutlass_dsl=catalogue;src:kernels_src/{op}={source_hash(family)[:16] if family.is_dir() else ''}"

        specs = variants((arch,), head_dims=head_dims, block_sizes=block_sizes)
        stamps = {op: fingerprint(op) for op in {s.op for s in specs}}
        entries = {s.name: s.entry(cubin=f"{s.name}.cubin", sha256="0" * 64, entry="kernel", fingerprint=stamps[s.op])
                   for s in specs}
        (tmp_path / arch).mkdir(parents=True, exist_ok=True)
        (tmp_path / arch / "manifest.json").write_text(
            Manifest(arch=arch, fingerprint={"cutlass_dsl": "catalogue"}, variants=entries).dumps())
        artifact_dir_env(tmp_path)
        monkeypatch.setattr(loader, "device_arch", lambda index: arch)

    return use
