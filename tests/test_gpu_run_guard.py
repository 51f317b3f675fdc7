"""The GPU run cannot pass by skipping (issue 40): with FLASH_MSA_REQUIRE_GPU=1 a GPU test that cannot run (no
GPU, no artifacts) fails, naming why; without it, it skips. Run as a child pytest on one small GPU test file, with
the artifacts pointed at an empty folder so that the answer is the same on a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

GPU_FILE = "tests/test_reference_cuda.py"


def _pytest_gpu(tmp_path, require):
    env = dict(os.environ, FLASH_MSA_ARTIFACT_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    env.pop("FLASH_MSA_REQUIRE_GPU", None)
    if require is not None:
        env["FLASH_MSA_REQUIRE_GPU"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-rA", "-p", "no:cacheprovider", GPU_FILE],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("require", [None, "0"])
def test_gpu_tests_skip_by_default(tmp_path, require):
    r = _pytest_gpu(tmp_path, require)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "SKIPPED" in r.stdout and "GPU test:" in r.stdout and "passed" not in r.stdout.splitlines()[-1]


def test_required_gpu_run_fails_when_it_cannot_run(tmp_path):
    r = _pytest_gpu(tmp_path, "1")
    assert r.returncode == 1, r.stdout[-3000:]
    assert "FLASH_MSA_REQUIRE_GPU=1 but this GPU test cannot run:" in r.stdout
    assert ("no CUDA device" in r.stdout) or ("artifacts under" in r.stdout), r.stdout[-3000:]
    assert "skipped" not in r.stdout.splitlines()[-1], r.stdout.splitlines()[-1]


def _resolve_on_cuda():
    """dispatch on a CUDA device for a problem no kernel takes (float32): the reference, with the warning (on a
    CPU machine the kernel backend declines for want of a device)."""
    import torch

    from flash_msa_rt.ops import dispatch

    return dispatch.implementation("msa_forward", torch.device("cuda", 0), torch.float32, head_dim=128,
                                   proxy_head_dim=128, block_size=128, group=4, kv_group=4, varlen=False)


def test_the_guard_sees_dispatchs_fallback():
    """The filter's message matches dispatch's warning, and dispatch's record names the op that fell back."""
    from tests import routing

    with pytest.warns(RuntimeWarning, match=routing.FALLBACK_MESSAGE):
        _resolve_on_cuda()
    assert routing.reference_fallbacks() == ["msa_forward"]
    with pytest.raises(AssertionError, match=r"instead of the kernels: \['msa_forward'\]"):
        routing.assert_ran_on_kernels(["msa_forward"])
    with pytest.raises(AssertionError, match=r"never dispatched on CUDA: \['msa_backward'\]"):
        routing.assert_ran_on_kernels(["msa_backward"])


@pytest.mark.filterwarnings("error:flash_msa. .* runs on the slow pure-PyTorch reference:RuntimeWarning")
def test_the_gpu_tests_filter_makes_the_fallback_an_error():
    """What conftest adds to every GPU test not marked allow_reference (routing.FALLBACK_FILTER, spelled out)."""
    from tests import routing

    assert routing.FALLBACK_FILTER == "error:flash_msa. .* runs on the slow pure-PyTorch reference:RuntimeWarning"
    with pytest.raises(RuntimeWarning, match="runs on the slow pure-PyTorch reference"):
        _resolve_on_cuda()
    with routing.allowed_reference():  # what a test that asks for the reference uses
        _resolve_on_cuda()
    assert routing.reference_fallbacks() == []  # forgotten on leaving the allowance
