"""Map a device's compute capability to the artifact archs that run on it, best first."""

from __future__ import annotations

from flash_msa_rt.errors import UnsupportedArchError

# Arch-specific "a" targets run only on their exact capability (sm_90a on 9.0, sm_100a on 10.0); the family
# target sm_100f runs on every 10.x part (B200 10.0, B300 10.3). Prefer the exact target where both are carried.
SUPPORTED = {(9, 0): ("sm90a",), (10, 0): ("sm100a", "sm100f")}
FAMILY = {10: ("sm100f",)}


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
