"""One small MSA forward + backward per G for compute-sanitizer (run under it): the main backward kernels the
runtime picks (at G <= 4 the warp-specialised one), and with the producer overridden off
(tuning.override(sparse_bwd={"producer": False}): an opt-in build variant) the kernel without one.

    compute-sanitizer --tool racecheck python benchmarks/sanitize_bwd.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    from flash_msa_rt import tuning
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda

    torch.manual_seed(0)
    for G, producer in ((4, True), (2, True), (1, True), (4, False)):
        with tuning.override(sparse_bwd={"producer": producer}):
            qp = torch.randn(2, 333, 2, 128, device="cuda").to(torch.bfloat16)
            kp = qp[:, :, :1]
            q = torch.randn(2, 333, 2 * G, 128, device="cuda").to(torch.bfloat16)
            kv = torch.randn(2, 333, 2, 128, device="cuda").to(torch.bfloat16)
            sel = select_blocks_cuda(qp, kp, 3, 128, 0.1)
            o, lse, lsep, kl = msa_forward_cuda(qp, kp, q, kv, kv, sel, 128, 0.1)
            msa_backward_cuda(qp, kp, q, kv, kv, o, lse, lsep, sel, 128, 0.1, torch.randn_like(q), kl)
    torch.cuda.synchronize()
    print("sanitize_bwd: done")


if __name__ == "__main__":
    main()
