"""Device time against host time of one flash_msa_func forward + backward at configuration (a), B = 1: the step's
kernels-level calls (select_blocks_cuda, msa_forward_cuda, msa_backward_cuda) replayed from a CUDA graph (no host
work: the device's own time) against eager steps back to back (whichever of
host and device is slower) and the host's enqueue time alone. Where eager is near the host's time and well above
the graph's, the size is host-bound.

    python benchmarks/device_time.py [8192,16384,32768,65536]
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import api_step  # noqa: E402
from benchmarks.common import back_to_back_ms, captured, host_enqueue_ms  # noqa: E402


def main():
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    sizes = (int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "8192,16384,32768,65536").split(","))
    for S in sizes:
        x, leaves, dout, step = api_step("a", S)
        d = [t.detach() for t in leaves]
        go, klg = dout.view_as(d[2]), torch.full((), 0.1 / (x["Hp"] * S), device="cuda")

        def kernels_step():  # the same work below the public API: selection, forward, backward
            sel = select_blocks_cuda(d[0], d[1], 16, 128, x["scale"])
            out, lse, lse_p, kl = msa_forward_cuda(*d, sel, 128, x["scale"])
            return msa_backward_cuda(*d, out, lse, lse_p, sel, 128, x["scale"], go, klg)

        graph, _ = captured(kernels_step)
        reps = 30
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - t0) / reps
        host, eager = host_enqueue_ms(step, reps, warmup=0), back_to_back_ms(step, reps)
        print(f"(a) B=1 S={S}: kernels graph replay {1e3 * replay:.3f} ms, eager back to back {eager:.3f} ms, "
              f"host enqueue {host:.3f} ms per fwd+bwd step", flush=True)
        del graph


if __name__ == "__main__":
    main()
