"""Where the sparse op's wall time goes between its kernels: the forward and the backward, each timed with CUDA
events and traced once under torch.profiler; per phase the device's busy time (kernels, memsets, copies), the span
from the first to the last device event, the idle gaps between them, and the largest gaps with the kernels around
them. A phase whose span is much longer than its busy time is waiting on the host (launches, torch ops) or on a
synchronisation.
Usage: python benchmarks/timeline.py [--api] [--python] SPEC [SPEC ...]
  SPEC as in bench_sparse_fwd.spec_problem: cfg:S or cfg:S:B;
  --api: the public op's whole step instead (flash_msa_func + autograd.grad, as bench_msa times it: selection,
         forward and backward in one stream);
  --python: the Python functions the host ran in each gap too (traced with with_stack, which slows the host: a
         gap that only shows with it is the tracer's).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import spec_problem  # noqa: E402
from benchmarks.common import commit, cuda_time_ms  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver")


def device_events(fn, python: bool = False) -> tuple[list[tuple[float, float, str, float]],
                                                     list[tuple[float, float, str]]]:
    """(start us, duration us, name, host launch time us) of every device event of one fn() call, in start order,
    and (start, duration, name) of the host's torch ops (python: and Python functions, traced with with_stack).
    The launch time is the runtime's (torch's kernels) or the driver's (the AOT kernels: cuLaunchKernelEx)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU], with_stack=python) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    launches = {e["args"]["correlation"]: float(e["ts"]) for e in trace["traceEvents"]
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    events = [(float(e["ts"]), float(e["dur"]), e["name"], launches.get(e.get("args", {}).get("correlation"), 0.0))
              for e in trace["traceEvents"] if e.get("cat") in DEVICE_CATS and "dur" in e]
    cats = HOST_CATS + (("python_function",) if python else ())
    host = [(float(e["ts"]), float(e["dur"]), e["name"]) for e in trace["traceEvents"]
            if e.get("cat") in cats and "dur" in e]
    return sorted(events), host


def summarise(label: str, fn, python: bool = False) -> None:
    ms = cuda_time_ms(fn, warmup=2, reps=5)
    ev, host = device_events(fn, python)
    busy = sum(e[1] for e in ev) / 1e3
    span = (ev[-1][0] + ev[-1][1] - ev[0][0]) / 1e3
    gaps = []
    for (t0, d0, n0, h0), (t1, _, n1, h1) in zip(ev, ev[1:]):
        gap = t1 - (t0 + d0)
        if gap > 0:
            # The host's longest torch ops between the two launches: what kept the next launch back.
            ops = sorted(((d, n) for s, d, n in host if h0 <= s and s + d <= h1), reverse=True)[:6 if python else 3]
            gaps.append((gap / 1e3, n0[:50], n1[:50], ", ".join(f"{n} {d / 1e3:.3f} ms" for d, n in ops)))
    gaps.sort(reverse=True)
    idle = sum(g[0] for g in gaps)
    print(f"{label}: events {ms:.2f} ms; traced span {span:.2f} ms, device busy {busy:.2f}, idle {idle:.2f} "
          f"over {len(ev)} device events")
    for g, a, b, ops in gaps[:6]:
        print(f"    gap {g:6.3f} ms  after {a}  before {b}\n        host: {ops}")


def main(argv=None) -> int:
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    args = list(argv if argv is not None else sys.argv[1:])
    api, python = "--api" in args, "--python" in args
    specs = [a for a in args if not a.startswith("--")] or ["b:65536"]
    print(f"{torch.cuda.get_device_name()}, commit {commit()}")
    if api:
        from benchmarks.profile_api import api_step

        for spec in specs:
            x, step = api_step(spec)
            summarise(f"{spec} public op fwd+bwd", step, python)
            del x, step
            torch.cuda.empty_cache()
        return 0
    for spec in specs:
        x = spec_problem(spec)
        qp, kp, q, k, v, sel, scale = (x[n] for n in ("qp", "kp", "q", "k", "v", "sel", "scale"))

        def forward():
            return msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)

        out, lse, lse_p, _ = forward()

        def backward():
            return msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, x["go"], x["kl_grad"])

        backward()
        summarise(f"{spec} forward", forward, python)
        summarise(f"{spec} backward", backward, python)
        del x, out, lse, lse_p
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
