"""python -m flash_msa_rt selftest: every shipped kernel family, on this GPU, against the reference.

Each check runs a small random problem through the public entry points (flash_msa_func, flash_msa_warmup_func,
block_sparse_attention, select_blocks, proxy_block_scores) and the plan kernels, and compares every result with
flash_msa_rt.reference run in float64 on the kernel's own selection, under flash_msa_rt.tolerances (a multiple of
what the input dtype costs, NaN / inf positions first). A check also fails when dispatch resolved its op to the
reference instead of a kernel: the point is to prove the cubins this machine loads, not the fallback.

--quick: one bfloat16 problem per family (the first problem of PROBLEMS); the full run adds float16 and every
G = H / Hp the kernels ship (1, 2, 4, 8, 16) with odd lengths and partial blocks.
"""

from __future__ import annotations

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
           "CHECKS", "BLOCK"]


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
    problems = problems or (PROBLEMS[:1] if quick else PROBLEMS)
    report = Report(device=name, arch=arch, quick=quick)
    with guard.suspended():  # the checks prove every family themselves, with the numbers the guard would hide
        _run_checks(report, arch, device, problems, echo, checks)
    report.kernels_loaded = loaded_kernels()
    return report


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
