"""Build specs: what build_tools needs to compile one variant and describe it in the manifest.

A kernel family (one op) provides, in a module that does NOT import cutlass at import time:
  - a frozen config dataclass whose fields are every codegen choice, and whose `variant_name(arch)` spells all
    of them (changing any field changes the name);
  - `can_implement(config, arch) -> (ok, reason)`;
  - `build_spec(config, arch) -> BuildSpec`: the param ABI, grid rule, block, cluster, shared memory, and the
    dotted path of the function that compiles it (imported only inside a build worker, where cutlass is);
  - `build_set(config, arch) -> str`: the build set (SETS) of the variant.

The compile function (each family's `build.py`: `compile(config, arch) -> Compiled`) runs with no GPU present, on
the machinery of kernels_src.compile.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from flash_msa_rt.manifest import Param, VariantEntry

# sm90a runs on compute capability 9.0 only and sm100a on 10.0 only (arch-specific targets). sm100f is the
# Blackwell family target (10.x, e.g. B300's 10.3): buildable on request, not in the default set.
ARCHS = ("sm90a", "sm100a", "sm100f")
DEFAULT_ARCHS = ("sm90a", "sm100a")

# Build sets: every variant of the catalogue is in one, per arch (each family's build_set(config, arch)).
#   default: what the runtime's default paths launch on the arch (its tuning policies, flash_msa_rt/ops);
#   hopper_sync_check: on sm90a, the mma.sync variants sm100a's default paths launch, so that the Blackwell path's
#     kernels run (and are tested) on Hopper too;
#   opt_in: alternates kept for A/B runs (other schedules, stages, knobs), built only on request.
# A variant joins the default set only when a default path runs it.
DEFAULT, HOPPER_SYNC_CHECK, OPT_IN = "default", "hopper_sync_check", "opt_in"
SETS = (DEFAULT, HOPPER_SYNC_CHECK, OPT_IN)
DEFAULT_SETS = (DEFAULT, HOPPER_SYNC_CHECK)  # what a build compiles unless asked otherwise


def mma_set(mma: str, arch: str) -> str:
    """The set of a variant on its default path but for the MMA: sm90a's default paths run wgmma, every other arch
    mma.sync (Blackwell has no wgmma), so mma.sync on sm90a is the hopper_sync_check."""
    return HOPPER_SYNC_CHECK if arch == "sm90a" and mma == "sync" else DEFAULT


# What CuTeDSL's --gpu-arch option calls each of our arch names.
GPU_ARCH_OPTION = {"sm90a": "sm_90a", "sm100a": "sm_100a", "sm100f": "sm_100f"}


@dataclass(frozen=True)
class Compiled:
    """The output of one cute.compile: SASS for the target plus the PTX it came from (for ABI checks)."""

    cubin: bytes
    ptx: str
    smem_bytes: int | None = None  # dynamic shared memory read back from the lowered host code, if found
    ptxas_warnings: tuple[str, ...] = ()  # ptxas's performance warnings ("C7514: ..."), from its verbose log


@dataclass(frozen=True)
class BuildSpec:
    name: str
    op: str
    arch: str
    config: dict[str, Any]
    params: tuple[Param, ...]
    grid: tuple[str, str, str]
    block: tuple[int, int, int]
    compile_fn: str  # "package.module:function", imported in the build worker only
    cluster: tuple[int, int, int] = (1, 1, 1)
    smem_bytes: int = 0
    hot: bool = True  # a hot kernel must not use local memory (spills fail the build)
    build_set: str = DEFAULT  # SETS: which builds compile it (the catalogue fills it from the family's build_set)
    config_obj: Any = field(default=None, compare=False, repr=False)

    def entry(self, **built: Any) -> VariantEntry:
        """The manifest entry, with the fields only the build knows (cubin, sha256, entry, registers...)."""
        return VariantEntry(
            name=self.name,
            op=self.op,
            arch=self.arch,
            config=dict(self.config),
            params=self.params,
            grid=self.grid,
            block=self.block,
            cluster=self.cluster,
            smem_bytes=self.smem_bytes,
            **built,
        )

    def compile(self) -> Compiled:
        module, _, func = self.compile_fn.partition(":")
        fn: Callable[[Any, str], Compiled] = getattr(importlib.import_module(module), func)
        return fn(self.config_obj, self.arch)


def family_spec(op: str, config: Any, arch: str, can_implement: Callable[[Any, str], tuple[bool, str]], *,
                params: tuple[Param, ...], grid: tuple[str, str, str], compile_fn: str, smem_bytes: int,
                block: tuple[int, int, int] | None = None) -> BuildSpec:
    """The BuildSpec of one variant of a family, refused with the family's reason when it cannot implement it.
    Named by every config field (flash_msa_rt.manifest.variant_name); one hot kernel per cubin."""
    from dataclasses import asdict

    from flash_msa_rt.manifest import variant_name

    ok, reason = can_implement(config, arch)
    if not ok:
        raise ValueError(f"{op}: cannot implement {config} on {arch}: {reason}")
    return BuildSpec(
        name=variant_name(op, asdict(config), arch),
        op=op,
        arch=arch,
        config=asdict(config),
        config_obj=config,
        params=params,
        grid=grid,
        block=block or (config.threads, 1, 1),
        compile_fn=compile_fn,
        smem_bytes=smem_bytes,
        hot=True,
    )


# Dynamic shared memory one CTA may opt into (227 KB on sm90a and sm100a/f).
MAX_SMEM = {"sm90a": 227 * 1024, "sm100a": 227 * 1024, "sm100f": 227 * 1024}


def refusal(config: Any, arch: str, notes: dict[str, str] | None = None, **supported) -> str | None:
    """Why a family cannot build config for arch, or None as far as these checks go: arch must be one of ARCHS
    and each named field one of its supported values (checked in the order given); notes[field] says why a
    field is limited. A family's can_implement adds what no list of values expresses, then smem_refusal."""
    if arch not in ARCHS:
        return f"arch {arch!r} not in {ARCHS}"
    for field_name, values in supported.items():
        value = getattr(config, field_name)
        if value not in values:
            note = f" ({notes[field_name]})" if notes and field_name in notes else ""
            return f"{field_name} {value!r} not supported; supported: {', '.join(map(repr, values))}{note}"
    return None


def smem_refusal(smem_bytes: int, arch: str) -> str | None:
    if smem_bytes > MAX_SMEM[arch]:
        return f"needs {smem_bytes} bytes of shared memory, {arch} allows {MAX_SMEM[arch]}"
    return None


def verdict(reason: str | None) -> tuple[bool, str]:
    """can_implement's (ok, reason) from the first refusal found (None: ok)."""
    return reason is None, reason or ""
