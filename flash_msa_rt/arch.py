"""Map a device's compute capability to the artifact arch that runs on it."""

from __future__ import annotations

from flash_msa_rt.errors import UnsupportedArchError

# sm_90a SASS runs only on 9.0 and sm_100a only on 10.0 (arch-specific "a" targets do not carry forward).
ARCH_BY_CAPABILITY = {(9, 0): "sm90a", (10, 0): "sm100a"}


def arch_for_capability(major: int, minor: int, device_name: str = "this GPU") -> str:
    arch = ARCH_BY_CAPABILITY.get((major, minor))
    if arch is None:
        supported = ", ".join(f"{a} (compute capability {M}.{m})" for (M, m), a in ARCH_BY_CAPABILITY.items())
        hint = ""
        if major == 10:
            hint = " Other Blackwell parts (10.x) need an sm_100f or sm_103a build, which is not in the catalogue yet."
        raise UnsupportedArchError(
            f"{device_name} has compute capability {major}.{minor}; flash-msa kernels are built for {supported}."
            + hint)
    return arch
