"""Context parallelism's per-rank compute on one GPU (issue 37): at S tokens in configuration (b), each of N zigzag
ranks' forward + backward (rank_attention: its two query chunks against the whole sequence's keys, no
communication) beside the single-GPU whole op, for N in 2, 4, 8; with the bytes each rank sends and receives per
step and the estimated step on N GPUs over NVLink.

Estimate (written with its assumptions): step = max over ranks of the rank's compute + the all-gather of k_proxy, k,
v and the reduce-scatter of their gradients, each moving (N - 1) / N of 4.25 KiB per token at 80 % of 900 GB/s per
GPU, not overlapped (an upper bound: the gather can overlap the local selection).

Run:  FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_cp_rank.py --out cp_rank.json
(the per-rank call takes the kernels' separate-key path, tuning.packed separate_keys="kernels"; --device cpu with a
small --seqlen runs it on the reference, as a check of this script only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import commit  # noqa: E402
from flash_msa_rt import flash_msa_func, tuning  # noqa: E402
from flash_msa_rt.distributed import shard_spans  # noqa: E402
from flash_msa_rt.distributed.attention import rank_attention  # noqa: E402

H, HK, HP, HPK, D, TOP_K = 32, 8, 8, 1, 128, 2048  # configuration (b)
NVLINK_BYTES_PER_S = 0.8 * 900e9  # assumed achievable share of NVLink's 900 GB/s per GPU for the collectives
KEY_BYTES_PER_TOKEN = (2 * HK * D + HPK * D) * 2  # k, v and k_proxy in bf16: what a rank gathers per token


def _timed(fn, device, warmup: int, reps: int) -> float:
    """Median wall ms of fn() (synchronised: each call is forward + backward, long against launch latency)."""
    times = []
    for n in range(warmup + reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if n >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    S = args.seqlen
    g = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(1, S, h, D, device=device, generator=g, dtype=dtype) for h in (HP, HPK, H, HK, HK)]
    dout = torch.randn(1, S, H * D, device=device, generator=g, dtype=dtype)
    kw = dict(kl_value="deferred", kl_metric=torch.zeros((), device=device), select_precision=args.select_precision)
    rows = []

    def whole():
        leaves = [t.detach().requires_grad_() for t in full]
        out, kl = flash_msa_func(*leaves, TOP_K, layout="bshd", **kw)
        torch.autograd.grad((out * dout).sum() + kl, leaves)

    whole_ms = _timed(whole, device, args.warmup, args.reps)
    print(f"single GPU, whole op fwd+bwd at S={S}: {whole_ms:.1f} ms", flush=True)
    with tuning.override(packed={"separate_keys": "kernels"}):
        for N in args.ranks:
            for r in sorted({0, N - 1}):
                spans = shard_spans(S, N, r, "zigzag")

                def rank_step(spans=spans):
                    qp, q = (torch.cat([t[:, a:b] for a, b in spans], 1).requires_grad_() for t in (full[0], full[2]))
                    keys = [t.detach().requires_grad_() for t in (full[1], full[3], full[4])]
                    out, kl = rank_attention(True, qp, keys[0], q, keys[1], keys[2], spans, TOP_K, **kw)
                    do = torch.cat([dout[:, a:b] for a, b in spans], 1).reshape(out.shape)
                    torch.autograd.grad((out * do).sum() + kl, [qp, q, *keys])

                ms = _timed(rank_step, device, args.warmup, args.reps)
                moved = 2 * (N - 1) / N * S * KEY_BYTES_PER_TOKEN  # gather + gradient reduce-scatter, each way
                comm_ms = moved / NVLINK_BYTES_PER_S * 1e3
                rows.append(dict(ranks=N, rank=r, tokens=sum(b - a for a, b in spans), rank_ms=ms,
                                 ideal_ms=whole_ms / N, rank_over_ideal=ms * N / whole_ms,
                                 bytes_sent_and_received=moved, comm_ms_estimate=comm_ms,
                                 step_ms_estimate=ms + comm_ms))
                print(f"N={N} rank {r}: {ms:.1f} ms ({rows[-1]['rank_over_ideal']:.2f}x the whole op / N), "
                      f"{moved / 1e9:.2f} GB moved, ~{comm_ms:.1f} ms over NVLink, step ~{ms + comm_ms:.1f} ms",
                      flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(benchmark="cp_rank", commit=commit(), device=name, seqlen=S, config="b",
                select_precision=args.select_precision, kl_value="deferred", whole_op_ms=whole_ms, rows=rows,
                assumptions=f"NVLink {NVLINK_BYTES_PER_S / 1e9:.0f} GB/s achieved per GPU, collectives not "
                            f"overlapped; per-rank compute measured on one GPU (simulated ranks)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=1 << 20)
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    ap.add_argument("--select-precision", default="fp8", choices=("bf16", "fp8"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
