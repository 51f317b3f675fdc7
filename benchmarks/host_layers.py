"""Where the host's time goes in one flash_msa_func forward + backward at configuration (a), B = 1 (host-bound at
small S): the median host enqueue time (after a synchronise, so nothing waits on the device) of each layer of the
same call, from the public function down to the runtime's CUDA entry points, and a cProfile of the whole step.

    python benchmarks/host_layers.py [8192,16384]

Layers: api (flash_msa_func + autograd.grad), the custom ops (torch.library dispatch + autograd), their bodies
(CustomOpDef._init_fn: our dispatch and checks), and the CUDA functions (select_blocks_cuda, msa_forward_cuda,
msa_backward_cuda) that plan and launch.
"""

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import api_step  # noqa: E402
from benchmarks.common import back_to_back_ms, host_enqueue_ms  # noqa: E402


def main():
    from flash_msa_rt.ops import library as lib
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    for S in (int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "8192,16384").split(",")):
        x, leaves, _, step = api_step("a", S)
        scale = x["scale"]
        d = [t.detach() for t in leaves]
        sel = lib.select_blocks(d[0], d[1], 16, 128, scale)
        fwd = lib.msa_forward(*d, sel, 128, scale)
        go, klg = torch.randn_like(d[2]), torch.full((1, 1, 1), 1e-3, device="cuda")
        rows = {
            "api: flash_msa_func + autograd.grad": step,
            "custom op select_blocks": lambda: lib.select_blocks(d[0], d[1], 16, 128, scale),
            "  select_blocks body (_init_fn)": lambda: lib.select_blocks._init_fn(d[0], d[1], 16, 128, scale),
            "  select_blocks_cuda": lambda: select_blocks_cuda(d[0], d[1], 16, 128, scale),
            "custom op msa_forward": lambda: lib.msa_forward(*d, sel, 128, scale),
            "  msa_forward body (_init_fn)": lambda: lib.msa_forward._init_fn(*d, sel, 128, scale),
            "  msa_forward_cuda": lambda: msa_forward_cuda(*d, sel, 128, scale),
            "custom op msa_backward": lambda: lib.msa_backward(*d, *fwd[:3], sel, 128, scale, go, klg),
            "  msa_backward body (_init_fn)": lambda: lib.msa_backward._init_fn(*d, *fwd[:3], sel, 128, scale, go,
                                                                           klg),
            "  msa_backward_cuda": lambda: msa_backward_cuda(*d, *fwd[:3], sel, 128, scale, go, klg),
        }
        print(f"(a) B=1 S={S}: host enqueue per call, median of 30 after a synchronise", flush=True)
        for name, fn in rows.items():
            print(f"  {name:40s} {host_enqueue_ms(fn):7.3f} ms", flush=True)
        print(f"  {'wall per api step (30 back to back)':40s} {back_to_back_ms(step):7.3f} ms")

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
        stats.print_stats(25)
        stats.print_callees("backend_impl")
        stats.print_callers("backend_impl")
        print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main()
