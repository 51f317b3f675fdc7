"""python -m flash_msa_rt selftest: every shipped kernel family, on this GPU, against the reference.

Each check runs a small random problem through the public entry points (flash_msa_func, flash_msa_warmup_func,
block_sparse_attention, select_blocks, proxy_block_scores) and the plan kernels, and compares every result with
flash_msa_rt.reference run in float64 on the kernel's own selection, under flash_msa_rt.tolerances (a multiple of
what the input dtype costs, NaN / inf positions first). A check also fails when dispatch resolved its op to the
reference instead of a kernel: the point is to prove the cubins this machine loads, not the fallback.

--quick: one bfloat16 problem per family (the first problem of PROBLEMS); the full run adds float16 and every
G = H / Hp the kernels ship (1, 2, 4, 8, 16) with odd lengths and partial blocks. Both run at D 128 with blocks of
128, then at every other (D, Bs) of the matrix whose kernels the installed artifacts carry for this arch
(`carried_configs`: the wheel's D 64, and whatever `python -m build_tools build --head-dim ... --block-size ...`
added): there the first problem (quick), or the first two (bf16 and f16).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from flash_msa_rt import guard
from flash_msa_rt.errors import NoGPUError
from flash_msa_rt.selftest.backends import on_kernels, resolved_backends
from flash_msa_rt.selftest.checks import (BLOCK, PROBLEMS, Problem, block_sparse_indices, check_block_scores,
                                          check_block_sparse, check_msa, check_plan, check_select, check_warmup,
                                          selection_comparison)
from flash_msa_rt.selftest.problems import DETERMINISTIC_ARCHS
from flash_msa_rt.selftest.report import HEADER, Report, Row, format_row, summary, write_json

__all__ = ["run", "device_arch", "Problem", "PROBLEMS", "Report", "Row", "HEADER", "format_row", "summary",
           "write_json", "resolved_backends", "on_kernels", "selection_comparison", "block_sparse_indices",
           "CHECKS", "BLOCK", "carried_configs", "matrix_problems"]


# (family, check, the archs that have its kernels: None = every arch the runtime supports)
CHECKS: tuple[tuple[str, Callable, tuple[str, ...] | None], ...] = (
    ("select", check_select, None),
    ("block_scores", check_block_scores, None),
    ("plan", check_plan, None),
    ("msa", check_msa, None),
    ("deterministic", lambda p, dev, seed: check_msa(p, dev, seed, deterministic=True), DETERMINISTIC_ARCHS),
    ("warmup", check_warmup, None),
    ("block_sparse", check_block_sparse, None),
)


def device_arch() -> tuple[str, str]:
    """(device name, arch) of the current GPU, or NoGPUError; the caller checks the arch is carried."""
    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA device is visible (torch.cuda.is_available() is False): the self-test runs the "
                         "kernels on an NVIDIA GPU of compute capability 9.0 or 10.x")
    from flash_msa_rt.loader import device_arch as arch_of

    index = torch.cuda.current_device()
    return torch.cuda.get_device_name(index), arch_of(index)


def run(quick: bool = False, problems: tuple[Problem, ...] | None = None, echo: Callable[[str], None] | None = None,
        checks=CHECKS) -> Report:
    """Run every check on the current GPU and return the report (never raises for a failing check: a check that
    raises becomes a FAIL row naming the exception). Raises NoGPUError without a GPU."""
    name, arch = device_arch()
    device = torch.device("cuda", torch.cuda.current_device())
    problems = problems or matrix_problems(PROBLEMS[:1] if quick else PROBLEMS, carried_configs(arch), quick)
    report = Report(device=name, arch=arch, quick=quick)
    with guard.suspended():  # the checks prove every family themselves, with the numbers the guard would hide
        _run_checks(report, arch, device, problems, echo, checks)
    report.kernels_loaded = loaded_kernels()
    return report


# The contract's matrix (docs/msa-semantics.md): head dims D and key blocks Bs.
HEAD_DIMS, BLOCK_SIZES = (64, 128, 256), (64, 128)


def carried_configs(arch: str) -> list[tuple[int, int]]:
    """(D, Bs) of the matrix whose MSA kernels this arch's artifacts carry in bf16: the sparse forward at D on the
    key blocks it runs (D 256: 64-key halves, tuning.head_dim) and the selection at Dp = min(D, 128) on blocks of
    Bs. Read from the manifest (the loader's index), so a configuration built later is checked too."""
    from flash_msa_rt import loader
    from flash_msa_rt.tuning.head_dim import kernel_block_size

    found = []
    for d in HEAD_DIMS:
        main = loader.built_values("sparse_fwd", "block_size", arch, head_dim=d, dtype="bf16")
        select = loader.built_values("select", "block_size", arch, head_dim=min(d, 128), dtype="bf16")
        found += [(d, bs) for bs in BLOCK_SIZES if kernel_block_size(d, bs) in main and bs in select]
    return found


def matrix_problems(problems: tuple[Problem, ...], configs: list[tuple[int, int]],
                    quick: bool) -> tuple[Problem, ...]:
    """problems at D 128 / Bs 128, then the first one (quick) or two of them at each other configuration."""
    others = [(d, bs) for d, bs in configs if (d, bs) != (BLOCK, BLOCK)]
    return tuple(problems) + tuple(dataclasses.replace(p, D=d, Bs=bs) for d, bs in others
                                   for p in problems[:1 if quick else 2])


def _run_checks(report: Report, arch: str, device, problems, echo, checks) -> None:
    t0 = time.perf_counter()
    for n, p in enumerate(problems):
        for family, check, archs in checks:
            if archs is not None and arch not in archs:
                rows = [Row(family, p.label(), "-", "-", None, None, 0.0, "skip",
                            f"no {family} kernels on {arch} (runs on the reference there by design)")]
            else:
                try:
                    rows = check(p, device, 1000 * n + len(report.rows))
                except Exception as e:  # a crash is a failure of that family, reported with the others
                    rows = [Row(family, p.label(), "-", "-", None, None, 0.0, "FAIL",
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")]
            report.rows.extend(rows)
            if echo is not None:
                for r in rows:
                    echo(format_row(r))
    report.seconds = time.perf_counter() - t0


def loaded_kernels() -> list[str]:
    """Names of the variants this process loaded (flash_msa_rt.loader's cache)."""
    from flash_msa_rt import loader

    return sorted({k.entry.name for k in list(loader._kernels.values())})
