"""The arch a tensor's device runs: what the tuning policies and the artifact lookups are asked about."""

from __future__ import annotations

import torch

from flash_msa_rt import loader

_archs: dict[int, str] = {}  # device index -> arch (the lookup reads the device's capability and the artifacts)


def arch_of(device: torch.device) -> str:
    """The device's arch ("sm90a", "sm100a", ...); "cpu" off CUDA (the emulated kernels of the CPU tests, which
    the policies treat as mma.sync's)."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _archs.get(index)
    if arch is None:
        arch = _archs[index] = loader.device_arch(index)
    return arch


def forget() -> None:
    """Drop the cached archs (tests that fake another device)."""
    _archs.clear()
