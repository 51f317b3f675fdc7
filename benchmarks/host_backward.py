"""Host time of one flash_msa_func forward + backward at configuration (a), B = 1 (where the host's work, not the
GPU's, bounds small S), with the proxy's tau read from the main backward (the runtime's choice) and recomputed
(FORCE_PROXY_HEADS = "resident"), in one process: the median host enqueue time of a call after a synchronise, and
the wall time per call.

    python benchmarks/host_backward.py [8192,16384]
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402


def main():
    from flash_msa_rt import flash_msa_func
    from flash_msa_rt.ops import sparse_bwd as sb

    for S in (int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "8192,16384").split(",")):
        x = random_problem("a", S, S)
        qp, kp, q, k, v = (x[n].detach().requires_grad_() for n in ("qp", "kp", "q", "k", "v"))
        dout = torch.randn(1, S, x["H"] * x["D"], device="cuda", dtype=torch.bfloat16)
        coef = torch.tensor(0.1, device="cuda")

        def step():
            out, kl = flash_msa_func(qp, kp, q, k, v, top_k=2048, layout="bshd")
            return torch.autograd.grad((out, kl), (qp, kp, q, k, v), (dout, coef))

        for name, force in (("tau", None), ("recompute", "resident")) * 2:
            sb.FORCE_PROXY_HEADS = force
            for _ in range(3):
                step()
            host = []
            for _ in range(30):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(30):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 30
            print(f"(a) B=1 S={S} {name:9s}: host enqueue {1e3 * statistics.median(host):.3f} ms, wall "
                  f"{1e3 * wall:.3f} ms per call", flush=True)
        sb.FORCE_PROXY_HEADS = None


if __name__ == "__main__":
    main()
