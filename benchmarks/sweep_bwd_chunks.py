"""The backward op at several tau budgets (chunks of heads, then of queries): does a chunk whose fp32 dq rows fit
the L2 help the dq reductions more than its extra launches cost? Gradients are compared with the default budget's.
Usage: python benchmarks/sweep_bwd_chunks.py SPEC [SPEC ...] (SPEC as in bench_sparse_fwd.spec_problem)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import spec_problem  # noqa: E402
from benchmarks.common import cuda_time_ms  # noqa: E402
from flash_msa_rt.ops import sparse_bwd as sb  # noqa: E402
from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda  # noqa: E402

def main(specs: list[str]) -> int:
    for spec in specs:
        x = spec_problem(spec)
        qp, kp, q, k, v, sel, scale = (x[n] for n in ("qp", "kp", "q", "k", "v", "sel", "scale"))
        out, lse, lse_p, _ = msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
        B, S, H, D = q.shape
        Hp, K = qp.shape[2], sel.shape[3]
        default = sb.tau_budget
        ref = None
        for mb in (None, 16, 32, 64, 128, 256, 512):
            sb.tau_budget = default if mb is None else (lambda *a, n=mb << 20: n)
            budget = sb.tau_budget(B, S, H, D)
            c = sb.tau_heads(B, S, Hp, x["Hk"], x["Hpk"], K, 128, budget, 256)
            chunk = sb.tau_chunk(B, S, c, K, 128, budget, 256)

            def f():
                return sb.msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, x["go"],
                                            x["kl_grad"])

            g = f()
            if ref is None:
                ref = g
            err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(g, ref))
            ms = cuda_time_ms(f, warmup=2, reps=5)
            n = (Hp // c) * -(-S // chunk)
            print(f"{spec} budget {mb} MB: {c} heads x {chunk} queries per chunk, {n} chunks: "
                  f"backward {ms:.2f} ms (max rel diff vs default {err:.1e})", flush=True)
        sb.tau_budget = default
        del x, out, lse, lse_p, ref, g
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["b:65536"]))
