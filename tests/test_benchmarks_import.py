"""Every script in benchmarks/ imports on a machine without a GPU, and does nothing at import: a module it needs
that was moved or deleted shows here, not in the next device run (timeline.py --api and clocks.py once imported
a profile_api module that no longer existed)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py")
                    if p.stem != "__init__")


def test_the_benchmark_scripts_are_found():
    assert {"bench_msa", "profile_api", "timeline", "clocks", "sanitize_plan"} <= set(BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_benchmark_script_imports_without_running(name):
    importlib.import_module(f"benchmarks.{name}")
