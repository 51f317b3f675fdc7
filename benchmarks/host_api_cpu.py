"""The host cost of the public API's own layer, on any machine (no GPU): flash_msa_func + torch.autograd.grad at
configuration (a) B = 1 with the three ops' bodies replaced by empty outputs of the right shapes (CPU tensors), so
what is timed is flash_msa_func's checks and views, torch.library's dispatch and autograd wrapper, the KL mean and
the autograd engine; then the cProfile of it. benchmarks/host_layers.py measures the same layer on the GPU machine.

    python benchmarks/host_api_cpu.py [S]
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flash_msa_rt import flash_msa_func  # noqa: E402
from flash_msa_rt.ops import dispatch  # noqa: E402


def empty_impl(op, device, dtype, **config):
    """dispatch.implementation with bodies that only allocate their outputs."""
    if op == "select_blocks":
        return lambda qp, kp, K, bs, scale, cu: torch.empty(qp.shape[0], qp.shape[2], qp.shape[1], K,
                                                            dtype=torch.int32)
    if op == "msa_forward":
        def forward(qp, kp, q, k, v, sel, bs, scale, cu):
            B, S, H, _ = q.shape
            return torch.empty_like(q), torch.empty(B, H, S), torch.empty(B, qp.shape[2], S), torch.empty(
                B, qp.shape[2], S)
        return forward
    if op == "msa_backward":
        return lambda qp, kp, q, k, v, *rest: tuple(torch.empty_like(t) for t in (qp, kp, q, k, v))
    raise KeyError(op)


def main(S: int = 256):
    dispatch.implementation = empty_impl
    H, Hk, Hp, D = 16, 2, 4, 128
    leaves = [torch.randn(1, S, h, D, dtype=torch.bfloat16).requires_grad_() for h in (Hp, 1, H, Hk, Hk)]
    dout, coef = torch.randn(1, S, H * D, dtype=torch.bfloat16), torch.tensor(0.1)

    def step():
        out, kl = flash_msa_func(*leaves, top_k=2048, layout="bshd")
        return torch.autograd.grad((out, kl), leaves, (dout, coef))

    for _ in range(50):
        step()
    t0 = time.perf_counter()
    for _ in range(500):
        step()
    print(f"(a) B=1 S={S}: the API layer, op bodies empty: {(time.perf_counter() - t0) / 500 * 1e6:.1f} us per "
          f"fwd + bwd step")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        step()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
