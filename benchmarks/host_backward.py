"""Host time of one flash_msa_func forward + backward at configuration (a), B = 1 (where the host's work, not the
GPU's, bounds small S), with the proxy's tau read from the main backward (the runtime's choice) and recomputed
(FORCE_PROXY_HEADS = "resident"), in one process: the median host enqueue time of a call after a synchronise, and
the wall time per call.

    python benchmarks/host_backward.py [8192,16384]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import api_step  # noqa: E402
from benchmarks.common import back_to_back_ms, host_enqueue_ms  # noqa: E402


def main():
    from flash_msa_rt.ops import sparse_bwd as sb

    for S in (int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "8192,16384").split(",")):
        _, _, _, step = api_step("a", S)
        for name, force in (("tau", None), ("recompute", "resident")) * 2:
            sb.FORCE_PROXY_HEADS = force
            host, wall = host_enqueue_ms(step), back_to_back_ms(step)
            print(f"(a) B=1 S={S} {name:9s}: host enqueue {host:.3f} ms, wall {wall:.3f} ms per call", flush=True)
        sb.FORCE_PROXY_HEADS = None


if __name__ == "__main__":
    main()
