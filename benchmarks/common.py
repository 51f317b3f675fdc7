"""Shared benchmark plumbing: CUDA-event timing, the commit measured, and JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
PEAK_TFLOPS = 770.0  # bf16 dense, measured on the H200 (shared/design/h200.md)
PEAK_TBPS = 4.0  # HBM copy bandwidth used for floors


def commit() -> str:
    """The commit measured: FLASH_MSA_COMMIT (set by whoever ships the tree to a GPU machine) or git."""
    if os.environ.get("FLASH_MSA_COMMIT"):
        return os.environ["FLASH_MSA_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cuda_time_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median of reps CUDA-event timings of fn()."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us_per_call(fn, calls: int = 2000, rounds: int = 5) -> float:
    """Host time per call in microseconds (best of rounds), the device kept from backing up the queue."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)
    return best


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = dict(payload, commit=commit(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                   python=platform.python_version(), date=time.strftime("%Y-%m-%d"))
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    out = os.environ.get("OUT")  # the GPU machine's folder that comes back
    if out:
        Path(out, path.name).write_text(path.read_text())
    return path
