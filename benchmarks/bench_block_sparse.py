"""block_sparse_attention (NSA / FSA selected attention, block indices given) against cuDNN dense causal attention
in the same run, and against FSA's figures published on this H200 (docs/h200.md, not re-measured).

Shape of FSA's published row: H = 16, Hk = 2, one selection per KV head (Hi = 2, kernel G = 8), block 128, 16 blocks
per query (its own block and 15 earlier ones drawn at random), D = 128, bf16, B = 1; plus configuration (b)'s heads
(H = 32, Hk = Hi = 8) at B * S = 128K tokens; with --shapes nsa, NSA's selected-attention shape (64 query heads,
4 KV groups, one selection per KV head, blocks of 64, 16 blocks per query, B = 1; issue 53). The L2 is flushed
(256 MB zeroed) before every timed call.
Usage: python benchmarks/bench_block_sparse.py [--shapes fsa,b] [--seqlens 8192,16384,32768,65536] [--reps 10]
(results/block_sparse.json; other shapes: results/block_sparse_<shapes>.json)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_msa import PUBLISHED  # noqa: E402
from benchmarks.bench_sparse_fwd import nnz_of  # noqa: E402
from benchmarks.common import flushed_event_times, write_results  # noqa: E402

K, D = 16, 128
SHAPES = {"fsa": (16, 2, 2, 128), "b": (32, 8, 8, 128), "nsa": (64, 4, 4, 64)}  # H, Hk, Hi, block size
FORMULAS = {"fwd": "4*D*nnz", "fwd+bwd": "3.5*4*D*nnz (h200.md's peer-table convention)",
            "dense fwd": "4*D*H*B*S*(S+1)/2", "dense fwd+bwd": "3.5*4*D*H*B*S*(S+1)/2",
            "nnz": "sum over (b, h, i) of the causal keys of the distinct blocks listed for (b, h // (H / Hi), i)"}


def local_and_random(B: int, Hi: int, S: int, gen: torch.Generator, BLOCK: int = 128) -> torch.Tensor:
    """int32 (B, Hi, S, K): each query's own block, then K - 1 distinct earlier blocks at random (-1 where fewer
    exist)."""
    nb = -(-S // BLOCK)
    own = torch.arange(S, device="cuda") // BLOCK
    score = torch.rand(B, Hi, S, nb, device="cuda", generator=gen)
    j, own = torch.arange(nb, device="cuda").view(1, 1, 1, nb), own.view(1, 1, S, 1)
    score = torch.where(j < own, score, torch.where(j == own, 2.0, -1.0))  # own block first, no later block
    top = torch.topk(score, min(K, nb), dim=-1)
    idx = torch.where(top.values >= 0, top.indices, -1).to(torch.int32)
    if idx.shape[-1] < K:
        idx = torch.cat([idx, idx.new_full((B, Hi, S, K - idx.shape[-1]), -1)], dim=-1)
    return idx.contiguous()


class Timer:
    def __init__(self, reps: int):
        self.reps = reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return statistics.median(flushed_event_times(fn, self.reps, self.flush))


def run(shape: str, S: int, B: int, timer: Timer) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from flash_msa_rt import block_sparse_attention
    from flash_msa_rt.ops import dispatch, kernels, library

    H, Hk, Hi, BLOCK = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(S)
    q, k, v, dout = (torch.randn(B, S, h, D, device="cuda", generator=gen).to(torch.bfloat16)
                     for h in (H, Hk, Hk, H))
    idx = local_and_random(B, Hi, S, gen, BLOCK)
    config = library._block_sparse_config(q, k, idx, BLOCK, None)
    backend = "kernels" if dispatch.implementation("block_sparse_forward", q.device, q.dtype, **config) \
        is kernels.KERNELS.ops["block_sparse_forward"] else "reference"
    nnz = nnz_of(idx, S, H // Hi, BLOCK)
    dense_pairs = B * H * S * (S + 1) // 2
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        return block_sparse_attention(*leaves, idx, BLOCK, layout="bshd")

    def fwd_bwd():
        return torch.autograd.grad(fwd(), leaves, dout)

    qd, kd, vd = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))

    def dense_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qd, kd, vd, is_causal=True, enable_gqa=True)

    def dense_fwd_bwd():
        return torch.autograd.grad(dense_fwd(), (qd, kd, vd), dout.transpose(1, 2))

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    row = {"shape": shape, "B": B, "S": S, "H": H, "Hk": Hk, "Hi": Hi, "K": K, "block_size": BLOCK, "backend": backend,
           "nnz": nnz, "nnz_fraction_of_dense": nnz / dense_pairs}
    row["fwd_ms"] = timer(fwd)
    row["fwd_bwd_ms"] = timer(fwd_bwd)
    row["peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
    row["dense_fwd_ms"] = timer(dense_fwd)
    row["dense_fwd_bwd_ms"] = timer(dense_fwd_bwd)
    row["fwd_tflops"] = 4 * D * nnz / row["fwd_ms"] / 1e9
    row["fwd_bwd_tflops"] = 3.5 * 4 * D * nnz / row["fwd_bwd_ms"] / 1e9
    row["dense_fwd_bwd_tflops"] = 3.5 * 4 * D * dense_pairs / row["dense_fwd_bwd_ms"] / 1e9
    row["x_dense"] = row["dense_fwd_bwd_ms"] / row["fwd_bwd_ms"]
    fsa = PUBLISHED["fsa_fwd_bwd"].get(S) if shape == "fsa" and B == 1 else None
    row["fsa_published_fwd_bwd_ms"] = fsa
    row["x_fsa"] = fsa / row["fwd_bwd_ms"] if fsa else None
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="8192,16384,32768,65536")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--shapes", default="fsa,b", help=f"of {sorted(SHAPES)}; b runs at 64K, B = 2 only")
    a = ap.parse_args(argv)
    timer = Timer(a.reps)
    rows = []
    print("effective TFLOPS:", "; ".join(f"{k}: {v}" for k, v in FORMULAS.items()))
    print(f"{'shape':>5} {'B':>2} {'S':>6} {'fwd ms/TF':>12} {'f+b ms/TF':>13} {'dense f+b':>13} {'x dense':>8} "
          f"{'FSA pub':>8} {'x FSA':>6} {'peak GB':>8} backend")
    shapes = a.shapes.split(",")
    runs = [(name, int(s), 1) for name in shapes if name != "b" for s in a.seqlens.split(",")]
    runs += [("b", 65536, 2)] if "b" in shapes else []
    for shape, S, B in runs:
        r = run(shape, S, B, timer)
        rows.append(r)
        fsa = f"{r['fsa_published_fwd_bwd_ms']:8.1f} {r['x_fsa']:6.2f}" if r["x_fsa"] else f"{'-':>8} {'-':>6}"
        print(f"{shape:>5} {B:>2} {S:>6} {r['fwd_ms']:6.2f}/{r['fwd_tflops']:<5.0f} "
              f"{r['fwd_bwd_ms']:7.2f}/{r['fwd_bwd_tflops']:<5.0f} {r['dense_fwd_bwd_ms']:7.2f}/"
              f"{r['dense_fwd_bwd_tflops']:<5.0f} {r['x_dense']:7.2f}x {fsa} {r['peak_gb']:8.2f} {r['backend']}",
              flush=True)
        torch.cuda.empty_cache()
    name = "block_sparse" if shapes == ["fsa", "b"] else "block_sparse_" + "_".join(shapes)
    path = write_results(name, {"formulas": FORMULAS, "fsa_source": PUBLISHED["source"], "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
