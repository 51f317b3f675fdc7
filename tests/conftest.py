"""Shared fixtures. GPU tests carry the `gpu` marker and are skipped (with the reason) where no GPU is usable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # build_tools and kernels_src are build-time packages, not installed
    sys.path.insert(0, str(REPO))


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
    if arch not in artifacts.carried_archs():
        return f"no {arch} artifacts under {artifacts.artifact_root()} (set FLASH_MSA_ARTIFACT_DIR)"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [i for i in items if "gpu" in i.keywords]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


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


@pytest.fixture
def force_mma(monkeypatch):
    """force_mma(kind): every sparse kernel family runs on that MMA ("sync" or "wgmma") for the test, so both
    builds are checked whatever the runtime picks; wgmma skips off sm90a."""
    def force(mma: str) -> None:
        from flash_msa_rt.loader import device_arch
        from flash_msa_rt.ops import sparse_fwd

        if mma == "wgmma" and device_arch(0) != "sm90a":
            pytest.skip("wgmma is sm90a only")
        monkeypatch.setattr(sparse_fwd, "FORCE_MMA", mma)

    return force
