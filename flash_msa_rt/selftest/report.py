"""The self-test's results: one Row per compared quantity, the Report, and the printed table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    """One table row: a quantity of one op family on one problem."""

    op: str
    variant: str  # the problem
    quantity: str
    backend: str  # the dispatch backend(s) that ran it, or "kernel" for the ops called directly
    max_error: float | None
    bound: float | None
    seconds: float
    status: str  # "ok", "FAIL", "skip"
    detail: str = ""


@dataclass
class Report:
    device: str
    arch: str
    quick: bool
    rows: list[Row] = field(default_factory=list)
    kernels_loaded: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.status == "FAIL"]

    def to_json(self) -> dict:
        from flash_msa_rt import __version__

        return {"version": __version__, "device": self.device, "arch": self.arch, "quick": self.quick,
                "passed": not self.failed, "seconds": round(self.seconds, 3), "rows": [asdict(r) for r in self.rows],
                "kernels_loaded": self.kernels_loaded}


HEADER = (f"{'op':<26} {'variant':<44} {'quantity':<15} {'backend':<8} {'error / tol':>21} {'ratio':>6} {'time':>9}"
          "  status")


def format_row(r: Row) -> str:
    if r.max_error is None:
        err, ratio = "-", "-"
    else:
        err = f"{r.max_error:.2e} / {r.bound:.2e}"
        ratio = f"{r.max_error / r.bound:.2f}" if r.bound > 0 and r.max_error != float("inf") else (
            "0.00" if r.max_error == 0 else "inf")
    line = (f"{r.op:<26} {r.variant:<44} {r.quantity:<15} {r.backend:<8} {err:>21} {ratio:>6} "
            f"{r.seconds * 1e3:>7.1f}ms  {r.status}")
    return line + (f"  ({r.detail})" if r.detail else "")


def summary(report: Report) -> str:
    ran = [r for r in report.rows if r.status != "skip"]
    if report.failed:
        head = f"FAILED: {len(report.failed)} of {len(ran)} checks"
    else:
        head = f"passed: {len(ran)} checks"
    skipped = len(report.rows) - len(ran)
    return (f"{head} ({skipped} skipped) on {report.device} ({report.arch}) in {report.seconds:.1f} s; "
            f"{len(report.kernels_loaded)} kernel variants loaded")


def write_json(report: Report, path) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=1)
