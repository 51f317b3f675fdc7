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


def flushed_event_times(fn, reps: int, flush: torch.Tensor) -> list[float]:
    """CUDA-event ms of reps back-to-back fn() calls, flush (a buffer larger than the L2) zeroed outside the events
    before each: the host enqueues ahead, as in training, and no call finds its inputs in the L2."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


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


def host_enqueue_ms(fn, reps: int = 30, warmup: int = 3) -> float:
    """Median host time of one fn() call that starts on an idle device (synchronised before each): the time the
    host takes to enqueue it, with nothing waiting on the device."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e3 * statistics.median(times)


def back_to_back_ms(fn, reps: int = 30) -> float:
    """Wall time per call of reps fn() calls in a row: whichever of the host and the device is slower."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


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


# Kernel families by how their names appear in a profile (sparse_bwd_proxy before sparse_bwd: a name matches the
# first family it contains).
FAMILIES = ("sparse_bwd_proxy", "sparse_bwd", "sparse_fwd", "sparse_kl", "sparse_combine_kl", "sparse_combine",
            "bwd_delta", "slot_sum", "select", "block_scores", "warmup_kl", "warmup_bwd_proxy")


def kernel_times(fn) -> str:
    """CUDA time per kernel family of one fn() call (torch profiler), largest first; every other kernel (torch's
    own) counts as "torch"."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if e.device_type.name != "CUDA" or e.self_device_time_total <= 0:
            continue
        flat = e.key.replace("/", "").replace(".", "")
        name = next((f for f in FAMILIES if f"kernels_src{f}" in flat), "torch")
        times[name] = times.get(name, 0.0) + e.self_device_time_total / 1e3
    return ", ".join(f"{n} {t:.2f} ms" for n, t in sorted(times.items(), key=lambda kv: -kv[1]))
