"""Shared benchmark plumbing: CUDA-event timing, the commit measured, and JSON results."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
PEAK_TFLOPS = 770.0  # bf16 dense, measured on the H200 (docs/h200.md)
PEAK_TBPS = 4.0  # HBM copy bandwidth used for floors


def commit() -> str:
    """The commit measured: FLASH_MSA_COMMIT (set by whoever ships the tree to a GPU machine: pass the hash
    itself, not `$(git rev-parse HEAD)` run over there) or git, "+dirty" where tracked files differ from that
    commit (a tree copied onto the GPU machine over an older .git reads as its old HEAD, dirty)."""
    if os.environ.get("FLASH_MSA_COMMIT"):
        return os.environ["FLASH_MSA_COMMIT"]
    try:
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
        changed = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], text=True,
                                          stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


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


def captured(step, warmup: int = 3):
    """(CUDA graph of step(), its outputs): step run `warmup` times on a side stream first (allocator, first-use
    checks), then captured on the current stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


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


class ClockSamples:
    """nvidia-smi sampling the SM clock, the power draw and the active clock-event (throttle) reasons every
    `period_ms` while the block runs (nothing where nvidia-smi is absent); .summary() after it: the H200 caps its
    power at 700 W, and a long run of heavy kernels lowers the clock (docs/h200.md), which a timing
    beside its clock explains.

        with ClockSamples() as clocks:
            run()
        clocks.summary()  # {"sm_clock_mhz": median, "sm_clock_min_mhz", "power_w": median, "power_capped": share}
    """

    QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
    SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap

    def __init__(self, period_ms: int = 20):
        self.period_ms = period_ms
        self.lines: list[str] = []
        self._proc = self._file = None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._file = tempfile.TemporaryFile("w+")
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                 "-lms", str(self.period_ms)], stdout=self._file, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._file.seek(0)
            self.lines = [ln.strip() for ln in self._file if ln.strip()]
            self._file.close()
        return False

    def summary(self) -> dict:
        clocks, power, capped = [], [], 0
        for ln in self.lines:
            parts = [p.strip() for p in ln.split(",")]
            try:
                c, w, why = float(parts[0]), float(parts[1]), int(parts[2], 16)
            except (IndexError, ValueError):
                continue
            clocks.append(c)
            power.append(w)
            capped += bool(why & self.SW_POWER_CAP)
        if not clocks:
            return {}
        return dict(sm_clock_mhz=statistics.median(clocks), sm_clock_min_mhz=min(clocks),
                    power_w=statistics.median(power), power_capped=capped / len(clocks), clock_samples=len(clocks))


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
            "bwd_delta", "slot_sum", "select", "block_scores", "warmup_kl", "warmup_bwd_proxy", "fp8_quant")


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
