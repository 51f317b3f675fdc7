"""Is a step's wall time above its kernels' sum because of gaps or because the clocks drop under load?

For each problem "cfg:S[:B]", one public fwd + bwd step (as profile_api.py runs it), in one process:
  - the profiler's kernel sum per step (3 steps) and those 3 steps' event time;
  - a cold step (after 5 s idle) and 40 steps back to back, each timed with events, while nvidia-smi samples the
    SM clock, the power draw and the active clock-event (throttle) reasons every 20 ms.
A wall time near the kernel sum on a cold step and above it under load, with the SM clock falling, is the clock.

    python benchmarks/clocks.py [b:65536 a:65536:1]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ClockSamples, commit  # noqa: E402
from benchmarks.profile_api import api_step  # noqa: E402


def timed(step, n: int) -> list[float]:
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        step()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def kernel_sum_ms(step, steps: int = 3) -> tuple[float, float]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = timed(step, steps)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.self_device_time_total for e in events) / 1e3 / steps, statistics.median(t)


def main(specs):
    print(f"commit {commit()}, {torch.cuda.get_device_name()}")
    for spec in specs:
        _, step = api_step(spec)
        timed(step, 3)
        ksum, prof_wall = kernel_sum_ms(step)
        time.sleep(5)
        cold = timed(step, 1)[0]
        with ClockSamples() as clocks:
            hot = timed(step, 40)
        print(f"{spec}: kernel sum {ksum:.2f} ms/step (those profiled steps {prof_wall:.2f}); cold step {cold:.2f}; "
              f"40 back to back: first 5 {statistics.median(hot[:5]):.2f}, last 10 {statistics.median(hot[-10:]):.2f},"
              f" median {statistics.median(hot):.2f} ms", flush=True)
        print(f"  {clocks.summary()}", flush=True)
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["b:65536", "a:65536:1"])
