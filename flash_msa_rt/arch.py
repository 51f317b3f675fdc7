"""Map a device's compute capability to the artifact archs that run on it, best first, and each arch to the
distribution that carries its cubins."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from flash_msa_rt.errors import UnsupportedArchError

# Arch-specific "a" targets run only on their exact capability (sm_90a on 9.0, sm_100a on 10.0); the family
# target sm_100f runs on every 10.x part (B200 10.0, B300 10.3). Prefer the exact target where both are carried.
SUPPORTED = {(9, 0): ("sm90a",), (10, 0): ("sm100a", "sm100f")}
FAMILY = {10: ("sm100f",)}
# The capabilities each arch's cubins run on, as messages print them.
RUNS_ON = {"sm90a": "9.0 only", "sm100a": "10.0 only", "sm100f": "every 10.x"}

# One distribution per arch carries its cubins (flash_msa_rt/_artifacts/<arch>/); the runtime distribution
# names them as extras. "flash-msa" itself is another project on PyPI (import package flash_msa).
RUNTIME_DIST = "flash-msa-rt"


def arch_dist(arch: str) -> str:
    return f"{RUNTIME_DIST}-{arch}"


def install_hint(arch: str) -> str:
    return (f"pip install \"{RUNTIME_DIST}[{arch}]\" (the {arch_dist(arch)} package), or from a source checkout "
            f"FLASH_MSA_ARCHS={arch} pip install -v .")


def arch_candidates(major: int, minor: int, device_name: str = "this GPU") -> tuple[str, ...]:
    archs = SUPPORTED.get((major, minor)) or FAMILY.get(major)
    if not archs:
        raise UnsupportedArchError(
            f"{device_name} has compute capability {major}.{minor}; flash-msa kernels are built for 9.0 (sm90a, "
            f"Hopper H100/H200) and 10.x (sm100a for 10.0, sm100f for the whole Blackwell 10.x family)")
    return archs


def arch_for_capability(major: int, minor: int, carried: list[str] | tuple[str, ...] = (),
                        device_name: str = "this GPU") -> str:
    """The first candidate arch that is carried; else the first candidate (whose absence the caller reports)."""
    archs = arch_candidates(major, minor, device_name)
    return next((a for a in archs if a in carried), archs[0])


def device_mismatch(name: str, major: int, minor: int, carried: list[str] | tuple[str, ...], where: str) -> str | None:
    """None when a carried arch runs on this device, else the message: the GPU, its capability, the archs
    installed and the package to install."""
    try:
        archs = arch_candidates(major, minor, name)
    except UnsupportedArchError as e:
        return str(e)
    if any(a in carried for a in archs):
        return None
    have = ", ".join(f"{a} (runs on {RUNS_ON.get(a, '?')})" for a in carried) or "none"
    return (f"{name} has compute capability {major}.{minor}, which runs {' or '.join(archs)} cubins; the archs "
            f"installed ({where}) are: {have}. Install {archs[0]}: {install_hint(archs[0])}")


def visible_gpus() -> list[tuple[str, int, int]]:
    """(name, major, minor) of the NVIDIA GPUs this process may use, without initialising CUDA in it (a forked
    worker could not use CUDA after that) and without torch: asks nvidia-smi, only where an NVIDIA driver is
    loaded. Honours a CUDA_VISIBLE_DEVICES of indices; other forms (UUIDs, MIG) list every GPU."""
    gpus = Path("/proc/driver/nvidia/gpus")
    smi = shutil.which("nvidia-smi")
    if not smi or not (gpus.is_dir() and any(gpus.iterdir())):
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        name, _, cap = line.rpartition(",")
        major, _, minor = cap.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            found.append((name.strip(), int(major), int(minor)))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        items = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.lstrip("-").isdigit() for v in items):
            picked = []
            for v in items:
                if int(v) < 0 or int(v) >= len(found):
                    break  # CUDA ignores the list from the first invalid index on
                picked.append(found[int(v)])
            found = picked
    return found
