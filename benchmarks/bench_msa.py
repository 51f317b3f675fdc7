"""Whole-op MSA benchmark (issues 4 and 5): selection, sparse forward and backward, the public op, warmup mode and
cuDNN dense attention on the same inputs, with effective TFLOPS, peak memory and the backend that ran each op.

Configurations (by default D = Dp = 128, bf16, block 128, top_k 2048 tokens = K 16 blocks): (a) H=16, Hk=2, Hp=4, Hpk=1;
(b) H=32, Hk=8, Hp=8, Hpk=1; (c) H=64, Hk=4, Hp=4, Hpk=1; (b64) is (b) with a smaller proxy, Dp = 64 (issue 36:
the other way to cheapen selection). B = tokens // S (128K tokens per step), or B = 1 with --batch1 (the shape of
the flash-msa 0.1.1 / FSA figures published in docs/h200.md, config (a)).

FLOPs follow msa-semantics.md ("FLOP conventions"); nnz is counted exactly from the block_indices the ops ran on.
Ops whose implementation is the pure-PyTorch reference (dispatch's fallback) are skipped where one call would take
longer than --max-seconds (estimated from a smaller S, or cut by an alarm) or S > --ref-max-seqlen, and recorded as
"skipped: reference backend (...)".

Run: FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_msa.py --configs a,b,c \
         --seqlens 8192,16384,32768,65536 --out benchmarks/results/msa.json
Dp = 64 beside Dp = 128: --configs b,b64 (e.g. --seqlens 65536,131072, and --batch1 --seqlens 262144,524288,1048576).
Plot (CPU machine, matplotlib): python benchmarks/plot_msa.py benchmarks/results/msa.json

Other head dims and key blocks (issue 53's matrix): --head-dim D (default 128), --proxy-head-dim Dp (default
min(D, 128): 64 at D = 64), --block-size Bs (default 128); top_k stays 2048 tokens (K = 2048 // Bs). Each
configuration writes its own JSON: --out, or --tag T (-> results/msa_T.json), or, when D / Dp / Bs differ from the
defaults, results/msa_matrix_d{D}_b{Bs}[_dp{Dp}].json. Issue 53's use (configuration (b), deferred KL):
    python benchmarks/bench_msa.py --configs b --kl-values deferred --seqlens 65536,131072 --ops sparse,dense \
        --head-dim 64 --block-size 128 --out benchmarks/results/msa_matrix_d64_b128.json
Speedup against S of several such files in one figure: python benchmarks/plot_matrix.py results/msa_matrix_*.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `flash_msa_rt` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import RESULTS, ClockSamples, commit, flushed_event_times  # noqa: E402

CONFIGS = {  # name -> (H, Hk, Hp, Hpk)
    "a": (16, 2, 4, 1),
    "b": (32, 8, 8, 1),
    "c": (64, 4, 4, 1),
}
# Configurations with a smaller proxy: name -> (the configuration whose heads it takes, Dp). Not run by default.
SMALL_PROXY = {"b64": ("b", 64)}
DEFAULT_CONFIGS = tuple(CONFIGS)
D = DP = 128
BLOCK = 128
TOP_K = 2048
TOKENS = 128 * 1024
SEQLENS = (8192, 16384, 32768, 65536, 131072)
OPS = ("sparse", "warmup", "dense")

FORMULAS = {
    "nnz": "sum over (b, h, i) of the causal keys in the blocks listed for (b, p(h), i) (duplicates once, -1 none)",
    "select_blocks": "2*Dp*Hp*B*S*(S+1)/2",
    "msa_forward": "4*D*nnz",
    "msa_backward": "10*D*nnz (main attention only; the proxy KL backward, 6*Dp*nnz_p, is not counted)",
    "msa_func.fwd": "4*D*nnz (main attention only; selection and KL not counted)",
    "msa_func.fwd+bwd": "3.5*4*D*nnz (h200.md's peer-table convention: main attention only)",
    "msa_func.bwd": "10*D*nnz / (fwd+bwd ms - fwd ms) (the whole op's backward, derived: comparisons' modes)",
    "warmup_func.fwd": "4*D*H*B*S*(S+1)/2 (dense causal)",
    "warmup_func.fwd+bwd": "3.5*4*D*H*B*S*(S+1)/2 (forward + backward at 2.5x forward)",
    "cudnn_dense.fwd": "4*D*H*B*S*(S+1)/2",
    "cudnn_dense.fwd+bwd": "3.5*4*D*H*B*S*(S+1)/2 (backward 2.5x forward)",
    "cudnn_dense.bwd": "10*D*H*B*S*(S+1)/2 / (fwd+bwd ms - fwd ms) (derived: comparisons' dense_bwd_tflops)",
    "x_dense": "cuDNN dense fwd+bwd ms / MSA whole-op fwd+bwd ms (> 1: MSA faster)",
    "x_published": "published ms / this run's ms (> 1: this run faster)",
}

# Figures published in docs/h200.md: measured on this H200 on 2026-11-29, NOT re-measured by this script.
# Shape: B=1, H=16, Hk=2, Hp=4, Hpk=1, D=128, bf16, top_k=2048 (config (a) with --batch1).
PUBLISHED = {
    "source": "published on this H200, 2026-11-29, not re-measured in this run (docs/h200.md)",
    "shape": {"config": "a", "B": 1, "H": 16, "Hk": 2, "Hp": 4, "Hpk": 1, "D": 128, "dtype": "bfloat16",
              "top_k": 2048},
    # S -> (fwd ms, fwd+bwd ms)
    "cudnn_dense": {8192: (0.51, 1.97), 16384: (1.79, 6.67), 32768: (7.02, 28.2), 65536: (29.4, 112.4)},
    "flash_msa_0.1.1": {8192: (5.48, 19.1), 16384: (11.4, 41.1), 32768: (24.6, 88.5), 65536: (55.5, 189.0)},
    # flash-msa 0.1.1 warmup op: S -> (fwd ms, fwd+bwd ms)
    "flash_msa_0.1.1_warmup": {8192: (0.76, 28.8), 16384: (1.95, 120.9)},
    # FSA (Triton NSA selected attention, block indices given: no selection cost), fwd+bwd ms, H=16, Hk=2,
    # block 128, 16 blocks.
    "fsa_fwd_bwd": {8192: 16.7, 16384: 23.2, 32768: 32.7, 65536: 53.7},
}


# --- FLOPs and nnz (pure functions; tested on the CPU) -----------------------------------------------------------

def causal_pairs(S: int) -> int:
    """Query-key pairs (i, t) with t <= i in one sequence of length S."""
    return S * (S + 1) // 2


def dense_nnz(B: int, H: int, S: int) -> int:
    return B * H * causal_pairs(S)


def shape_of(name: str, proxy_head_dim: int = DP) -> tuple[int, int, int, int, int]:
    """(H, Hk, Hp, Hpk, Dp) of a configuration name (CONFIGS, or SMALL_PROXY's, whose Dp wins over
    proxy_head_dim, the run's --proxy-head-dim)."""
    base, dp = SMALL_PROXY.get(name, (name, proxy_head_dim))
    return (*CONFIGS[base], dp)


def default_proxy_head_dim(head_dim: int) -> int:
    """Dp when --proxy-head-dim is not given: 64 at D = 64, else 128, capped at D."""
    return min(head_dim, DP)


def matrix_tag(head_dim: int, proxy_head_dim: int, block_size: int) -> str | None:
    """The output's name for a non-default (D, Dp, Bs): matrix_d{D}_b{Bs}, _dp{Dp} added where Dp is not the
    default for D; None for the defaults (results/msa.json as before)."""
    if (head_dim, proxy_head_dim, block_size) == (D, DP, BLOCK):
        return None
    tag = f"matrix_d{head_dim}_b{block_size}"
    return tag + (f"_dp{proxy_head_dim}" if proxy_head_dim != default_proxy_head_dim(head_dim) else "")


def shape_record(args) -> dict:
    """The JSON's 'shape': the run's D, Dp, Bs, top_k, K and per configuration its heads and Dp."""
    return dict(D=args.head_dim, Dp=args.proxy_head_dim, block_size=args.block_size, top_k=TOP_K,
                K=TOP_K // args.block_size, dtype="bfloat16", tag=args.tag,
                configs={c: dict(zip(("H", "Hk", "Hp", "Hpk", "Dp"), shape_of(c, args.proxy_head_dim)))
                         for c in args.configs})


def selection_flops(B: int, S: int, Hp: int, Dp: int = DP) -> float:
    return 2 * Dp * Hp * B * causal_pairs(S)


def main_forward_flops(nnz: int, D: int = D) -> float:
    return 4 * D * nnz


def main_backward_flops(nnz: int, D: int = D) -> float:
    return 10 * D * nnz


def whole_fwd_bwd_flops(nnz: int, D: int = D) -> float:
    return 3.5 * 4 * D * nnz


def dense_forward_flops(B: int, H: int, S: int, D: int = D) -> float:
    return 4 * D * dense_nnz(B, H, S)


def dense_fwd_bwd_flops(B: int, H: int, S: int, D: int = D) -> float:
    return 3.5 * dense_forward_flops(B, H, S, D)


def tflops(flops: float | None, ms: float | None) -> float | None:
    return flops / ms / 1e9 if flops and ms else None


def nnz_per_index_head(block_indices: torch.Tensor, block_size: int = BLOCK, rows: int = 4096) -> int:
    """sum over (b, p, i) of |A(i)|: the causal keys of the listed blocks, duplicates counted once, -1 ignored.

    block_indices (B, Hp, S, K) integer on any device; the count runs there with torch ops, S in chunks of rows.
    Block j holds keys [j*Bs, min((j+1)*Bs, S)); query i sees min(i + 1, (j+1)*Bs) - j*Bs of them (clamped to
    [0, Bs]), which also covers the partial last block since i < S.
    """
    B, Hp, S, K = block_indices.shape
    total = torch.zeros((), dtype=torch.int64, device=block_indices.device)
    for i0 in range(0, S, rows):
        idx = block_indices[:, :, i0:i0 + rows].long().sort(dim=-1).values
        dup = torch.zeros_like(idx, dtype=torch.bool)
        dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
        i = torch.arange(i0, i0 + idx.shape[2], device=idx.device).view(1, 1, -1, 1)
        start = idx * block_size
        seen = (torch.minimum(i + 1, start + block_size) - start).clamp(0, block_size)
        total += torch.where((idx >= 0) & ~dup, seen, torch.zeros_like(seen)).sum()
    return int(total)


def nnz_main(block_indices: torch.Tensor, H: int, block_size: int = BLOCK) -> int:
    """nnz of the contract: every one of the H / Hp main heads of a proxy group sees its group's keys."""
    return nnz_per_index_head(block_indices, block_size) * (H // block_indices.shape[1])


def skewed_block_indices(B: int, Hp: int, S: int, K: int, block_size: int = BLOCK, device=None) -> torch.Tensor:
    """The load-balance worst case of kernel-notes.md: every query picks block 0 and its nearest preceding blocks.

    Row i (block q = i // Bs): blocks 0..q when q < K, else {0} + {q-K+2, ..., q}; ascending, -1 last.
    """
    q = (torch.arange(S, device=device) // block_size).view(S, 1)
    m = torch.arange(K, device=device).view(1, K)
    near = torch.where(m == 0, torch.zeros_like(q + m), q - (K - 1) + m)
    all_before = torch.where(m <= q, m, torch.full_like(m + q, -1))
    idx = torch.where(q >= K, near, all_before).to(torch.int32)
    return idx.view(1, 1, S, K).expand(B, Hp, S, K).contiguous()


# --- command line ------------------------------------------------------------------------------------------------

def _csv(kind, allowed=None):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty list {text!r}")
        out = []
        for x in items:
            try:
                v = kind(x)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{x!r} is not a valid {kind.__name__}") from None
            if allowed is not None and v not in allowed:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(allowed)}")
            if kind is int and v < 1:
                raise argparse.ArgumentTypeError(f"{x!r} must be positive")
            out.append(v)
        return out
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Whole-op MSA benchmark: per-op sparse (select / forward / backward), the public "
                    "flash_msa_func, warmup mode and cuDNN dense attention; JSON + table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", type=_csv(str, tuple(CONFIGS) + tuple(SMALL_PROXY)), default=list(DEFAULT_CONFIGS),
                   help="configurations: a (H16 Hk2 Hp4), b (H32 Hk8 Hp8), c (H64 Hk4 Hp4), all Hpk=1, D and Dp "
                        "from --head-dim / --proxy-head-dim; b64: b with Dp=64")
    p.add_argument("--head-dim", type=int, default=D, help="D of q, k, v (and of the cuDNN dense baseline)")
    p.add_argument("--proxy-head-dim", type=int, default=None,
                   help="Dp of q_proxy, k_proxy (default: 64 at D = 64, else 128, capped at D)")
    p.add_argument("--block-size", type=int, default=BLOCK,
                   help=f"key block Bs; top_k stays {TOP_K} tokens, K = {TOP_K} // Bs blocks")
    p.add_argument("--tag", default=None,
                   help="name of this configuration: recorded in shape.tag, and the output is results/msa_<tag>.json "
                        "unless --out (default with D/Dp/Bs not the defaults: matrix_d{D}_b{Bs}[_dp{Dp}])")
    p.add_argument("--seqlens", type=_csv(int), default=list(SEQLENS), help="sequence lengths S")
    p.add_argument("--ops", type=_csv(str, OPS), default=list(OPS),
                   help="sparse: select/forward/backward ops and flash_msa_func; warmup: flash_msa_warmup_func; "
                        "dense: cuDNN SDPA")
    p.add_argument("--batch1", action="store_true", help="B=1 instead of B = tokens // S")
    p.add_argument("--kl-values", type=_csv(str, ("exact", "deferred", "none")), default=["exact"],
                   help="kl_value modes of the public ops (rows of a mode other than exact are named op/mode; "
                        "deferred passes a kl_metric)")
    p.add_argument("--select-precisions", type=_csv(str, ("bf16", "fp8")), default=["bf16"],
                   help="select_precision of the selection and the public sparse op (rows of fp8 are named op/fp8, "
                        "or op/<kl_value>+fp8)")
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens per step: B = max(1, tokens // S)")
    p.add_argument("--skewed", action="store_true",
                   help="also time msa_forward/msa_backward on a skewed selection (block 0 + nearest blocks)")
    p.add_argument("--max-seconds", type=float, default=2.0,
                   help="longest single call allowed for a reference-backed op (estimated or cut by an alarm)")
    p.add_argument("--ref-max-seqlen", type=int, default=16384,
                   help="reference-backed ops are never run above this S")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (median reported)")
    p.add_argument("--budget-seconds", type=float, default=3.0,
                   help="fewer repetitions (>= 1) for an op whose calls would take longer than this in total")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/msa.json, msa_batch1.json with --batch1)")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.warmup < 0 or args.reps < 1 or args.max_seconds <= 0 or args.budget_seconds <= 0:
        p.error("--tokens and --reps must be >= 1, --warmup >= 0, --max-seconds and --budget-seconds > 0")
    if args.proxy_head_dim is None:
        args.proxy_head_dim = default_proxy_head_dim(args.head_dim)
    if args.head_dim < 1 or args.proxy_head_dim < 1:
        p.error("--head-dim and --proxy-head-dim must be >= 1")
    if args.block_size < 1 or TOP_K % args.block_size:
        p.error(f"--block-size must divide top_k = {TOP_K} tokens (64 or 128: K = 32 or 16 blocks)")
    if args.tag is not None and (not args.tag or "/" in args.tag or args.tag.startswith(".")):
        p.error(f"--tag {args.tag!r}: a file name part (no '/', not empty)")
    if args.tag is None:
        args.tag = matrix_tag(args.head_dim, args.proxy_head_dim, args.block_size)
    if args.out is None:
        stem = f"msa_{args.tag}" if args.tag else "msa"
        args.out = RESULTS / (f"{stem}_batch1.json" if args.batch1 else f"{stem}.json")
    return args


def batch_of(args, S: int) -> int:
    return 1 if args.batch1 else max(1, args.tokens // S)


# --- timing ------------------------------------------------------------------------------------------------------

class ReferenceTimeout(Exception):
    pass


class Alarm:
    """Cut a call after `seconds`: SIGALRM raises ReferenceTimeout in the main thread (the reference is a Python loop
    of launches, so the signal lands between launches). `rang` stays set in case a layer re-wraps the exception."""

    def __init__(self):
        self.rang = False

    @contextlib.contextmanager
    def limit(self, seconds: float | None):
        self.rang = False
        if not seconds:
            yield
            return

        def ring(signum, frame):
            self.rang = True
            raise ReferenceTimeout(f"one call exceeded {seconds:g} s")

        old = signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


class Timer:
    """CUDA-event timing: warmup calls, then the median of reps, with the L2 flushed before every timed call.

    Flushing keeps small B=1 inputs from being timed out of the 60 MB L2 while large ones are not (METHOD.md:
    one rule for every size). The flush (zeroing a 256 MB buffer) runs outside the events. The first call runs
    under the alarm for reference-backed ops and gives the peak memory; warmup calls are timed with the host clock
    to size the repetitions: min(--reps, --budget-seconds / call), at least 3 (at least 1 for a reference-backed
    op, which also stops warming up once a call exceeds --budget-seconds).
    """

    def __init__(self, args):
        self.args = args
        self.alarm = Alarm()
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    @staticmethod
    def _host_time(fn) -> float:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def run(self, fn, limit_s: float | None, reference: bool = False):
        """Time fn; a reference-backed fn (reference=True) runs under the alarm and may get a single rep."""
        a = self.args
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with self.alarm.limit(limit_s):
            first_s = self._host_time(fn)
        peak = torch.cuda.max_memory_allocated() - base
        per_call = first_s
        for _ in range(max(a.warmup - 1, 0)):
            if reference and per_call > a.budget_seconds:
                break  # a kernel's first call may be slow once (module load, handles); the reference's is not
            per_call = min(per_call, self._host_time(fn))
        reps = min(a.reps, max(1 if reference else 3, int(a.budget_seconds / per_call)))
        with ClockSamples() as clocks:
            times = flushed_event_times(fn, reps, self.flush)
        return dict(ms=statistics.median(times), times_ms=times, reps=reps, first_call_s=first_s,
                    peak_mem_bytes=peak, **clocks.summary())


class ReferenceGuard:
    """Per op key, the seconds one reference call took at (B, S) (inf: cut by the alarm), to skip larger sizes.

    Scaling to a larger problem takes the larger of B*S^2 (score elements) and (B*S)^2*S (the reference re-reads
    the causal K/V prefix once per row chunk of ~2^24 / (B*H*S) rows), so estimates err towards skipping.
    """

    def __init__(self):
        self.seen: dict[str, list[tuple[int, int, float]]] = {}

    def record(self, key: str, B: int, S: int, seconds: float):
        self.seen.setdefault(key, []).append((B, S, seconds))

    def estimate(self, key: str, B: int, S: int) -> float | None:
        smaller = [(b, s, t) for b, s, t in self.seen.get(key, []) if s <= S]
        if not smaller:
            return None
        b, s, t = max(smaller, key=lambda x: x[1])
        return t * max(B * S * S / (b * s * s), (B * S) ** 2 * S / ((b * s) ** 2 * s))

    def estimate_call(self, key: str, part_keys: list[str], B: int, S: int) -> float | None:
        """One call of a composite (e.g. the public op): the larger of its own history and the sum of its
        reference-backed parts' estimates; None when none of them ran at this or a smaller S."""
        parts = [e for e in (self.estimate(k, B, S) for k in part_keys) if e is not None]
        known = [e for e in (self.estimate(key, B, S), sum(parts) if parts else None) if e is not None]
        return max(known) if known else None


# --- the benchmark -----------------------------------------------------------------------------------------------

def backend_of(op: str, like: torch.Tensor, config: dict) -> str:
    """Name of the dispatch backend that runs `op` for this problem (what flash_msa_rt.ops.library would call)."""
    from flash_msa_rt.ops import dispatch

    impl = dispatch.implementation(op, like.device, like.dtype, **config)
    for b in dispatch.backends():
        if b.ops.get(op) is impl:
            return b.name
    return "unknown"


class Case:
    """One (config, S): inputs, backends and the measurements."""

    def __init__(self, name, args, S, timer, guard, rows, device="cuda"):
        from flash_msa_rt.ops import library

        self.name, self.args, self.S, self.timer, self.guard, self.rows = name, args, S, timer, guard, rows
        self.device = device  # "cuda"; the CPU test runs tiny shapes on the reference with a host timer
        self.H, self.Hk, self.Hp, self.Hpk, self.Dp = shape_of(name, args.proxy_head_dim)
        # D and BLOCK below are this run's --head-dim and --block-size (locals over the module's defaults)
        self.D, self.Bs = D, BLOCK = args.head_dim, args.block_size
        self.B = batch_of(args, S)
        self.K = TOP_K // BLOCK
        self.scale = D ** -0.5
        torch.manual_seed(args.seed)
        B, H, Hk, Hp, Hpk = self.B, self.H, self.Hk, self.Hp, self.Hpk
        randn = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16)  # noqa: E731
        # (B, S, heads, D) tensors: the runtime's layout, passed to the public op with layout="bshd" (no copies).
        self.qp, self.kp = randn(B, S, Hp, self.Dp), randn(B, S, Hpk, self.Dp)
        self.q, self.k, self.v = randn(B, S, H, D), randn(B, S, Hk, D), randn(B, S, Hk, D)
        self.dout = randn(B, S, H, D)
        self.kl_coef = torch.tensor(0.1, device=device)
        self.kl_grad = torch.full((), 0.1 / (B * Hp * S), device=device)  # d(0.1 * mean kl_rows) / d kl_rows
        msa_cfg = library._msa_config(self.qp, self.q, self.k, BLOCK, None, None)
        self.backends = {
            "select_blocks": backend_of("select_blocks", self.qp, {"proxy_head_dim": self.Dp, "block_size": BLOCK,
                                                                   "top_k_blocks": self.K, "varlen": False}),
            "select_blocks/fp8": backend_of("select_blocks", self.qp, {
                "proxy_head_dim": self.Dp, "block_size": BLOCK, "top_k_blocks": self.K, "varlen": False,
                "select_precision": "fp8"}),
            "msa_forward": backend_of("msa_forward", self.q, msa_cfg),
            "msa_backward": backend_of("msa_backward", self.q, msa_cfg),
            "warmup_forward": backend_of("warmup_forward", self.q, library._msa_config(self.qp, self.q, self.k,
                                                                                        None, None, None)),
            "warmup_backward": backend_of("warmup_backward", self.q, library._msa_config(self.qp, self.q, self.k,
                                                                                          None, None, None)),
        }
        self.block_indices = None

    def base(self, op: str, selection: str | None) -> dict:
        return dict(config=self.name, H=self.H, Hk=self.Hk, Hp=self.Hp, Hpk=self.Hpk, D=self.D, Dp=self.Dp,
                    block_size=self.Bs, K=self.K, top_k=TOP_K, B=self.B, S=self.S, tokens=self.B * self.S,
                    batch_mode="B=1" if self.args.batch1 else f"B=tokens//S (tokens={self.args.tokens})",
                    op=op, selection=selection)

    def key(self, op: str) -> str:
        return f"{self.name}:{op}"  # reference cost history is per configuration

    def estimate(self, op: str, on_reference: list[str]) -> float | None:
        return self.guard.estimate_call(self.key(op), [self.key(o) for o in on_reference if o != op], self.B,
                                        self.S)

    def measure(self, op, fn, *, ops_used=(), flops=None, selection=None, backend=None, extra=None):
        """Time fn and append a row; reference-backed ops go through the guard. Returns the row."""
        row = self.base(op, selection)
        backends = {o: self.backends[o] for o in ops_used}
        row["backend"] = backend if backend is not None else (
            backends[ops_used[0]] if len(ops_used) == 1 else backends)
        row["formula"] = FORMULAS.get(op.split("/")[0])  # "msa_func.fwd/deferred": msa_func.fwd's formula
        row.update(extra or {})
        on_reference = [o for o, b in backends.items() if b == "reference"]
        limit = None
        if on_reference:
            limit = self.args.max_seconds
            why = None
            if self.S > self.args.ref_max_seqlen:
                why = f"S > --ref-max-seqlen {self.args.ref_max_seqlen}"
            else:
                estimate = self.estimate(op, on_reference)
                if estimate is not None and math.isinf(estimate):
                    why = "a call at this or a smaller S was cut by the --max-seconds alarm"
                elif estimate is not None and estimate > limit:
                    why = f"estimated {estimate:.3g} s per call from a smaller S > --max-seconds {limit:g}"
            if why:
                return self._finish(row, status=f"skipped: reference backend ({', '.join(on_reference)}; {why})")
        try:
            result = self.timer.run(fn, limit, reference=bool(on_reference))
        except Exception as e:  # noqa: BLE001 - a failed op is a row, not the end of the run
            if self.device != "cpu":
                torch.cuda.synchronize()
            if isinstance(e, ReferenceTimeout) or self.timer.alarm.rang:
                for key in [op, *on_reference]:
                    self.guard.record(self.key(key), self.B, self.S, math.inf)
                return self._finish(row, status=f"skipped: reference backend ({', '.join(on_reference)}; one "
                                                f"call exceeded --max-seconds {limit:g})")
            if isinstance(e, torch.cuda.OutOfMemoryError):
                return self._finish(row, status=f"error: out of memory ({str(e).splitlines()[0][:200]})")
            return self._finish(row, status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if on_reference:
            # the median, not the first call: that one also pays one-time costs (allocator growth, handles)
            self.guard.record(self.key(op), self.B, self.S, result["ms"] / 1e3)
        row.update(result, status="ok", flops=flops, tflops=tflops(flops, result["ms"]))
        return self._finish(row)

    def _finish(self, row, status=None):
        if status is not None:
            row.update(status=status, ms=None, tflops=None, flops=None)
        self.rows.append(row)
        torch.cuda.empty_cache()
        return row

    # --- sparse mode ---

    def sparse(self):
        from flash_msa_rt import flash_msa_func

        ops = torch.ops.flash_msa
        qp, kp, q, k, v = self.qp, self.kp, self.q, self.k, self.v

        def select(precision="bf16"):
            return ops.select_blocks(qp, kp, self.K, self.Bs, self.scale, None, None, None, precision)

        with torch.no_grad():
            row = self.measure("select_blocks", select, ops_used=("select_blocks",),
                               flops=selection_flops(self.B, self.S, self.Hp, self.Dp), selection="proxy top-K")
            if row["status"] != "ok":  # without the selection nothing below has inputs: say so per op
                for op, selection in [("msa_forward", "proxy top-K"), ("msa_backward", "proxy top-K"),
                                      ("msa_func.fwd", "proxy top-K"), ("msa_func.fwd+bwd", "proxy top-K")]:
                    self._finish(dict(self.base(op, selection), backend=None, formula=FORMULAS[op]),
                                 status=f"skipped: needs select_blocks ({row['status']})")
                return
            for precision in self.args.select_precisions:
                if precision != "bf16":
                    self.measure(f"select_blocks/{precision}", lambda: select(precision),
                                 ops_used=(f"select_blocks/{precision}",),
                                 flops=selection_flops(self.B, self.S, self.Hp, self.Dp), selection="proxy top-K",
                                 extra=dict(select_precision=precision))
            self.block_indices = select()
        nnz = nnz_main(self.block_indices, self.H, self.Bs)
        nnz_p = nnz_per_index_head(self.block_indices, self.Bs)
        self._per_op("proxy top-K", self.block_indices, nnz, nnz_p)

        qp_g, kp_g, q_g, k_g, v_g = (t.detach().requires_grad_() for t in (qp, kp, q, k, v))
        dout = self.dout.view(self.B, self.S, self.H * self.D)
        info = dict(nnz=nnz, nnz_fraction_of_dense=nnz / dense_nnz(self.B, self.H, self.S), layout="bshd")

        for precision, kl_value in [(p, m) for p in self.args.select_precisions for m in self.args.kl_values]:
            metric = torch.zeros((), device=self.device) if kl_value == "deferred" else None

            def whole_fwd():
                return flash_msa_func(qp_g, kp_g, q_g, k_g, v_g, top_k=TOP_K, layout="bshd", kl_value=kl_value,
                                      kl_metric=metric, select_precision=precision, block_size=self.Bs)

            def whole_fwd_bwd():
                out, kl_loss = whole_fwd()
                return torch.autograd.grad((out, kl_loss), (qp_g, kp_g, q_g, k_g, v_g), (dout, self.kl_coef))

            used = ("select_blocks" if precision == "bf16" else f"select_blocks/{precision}", "msa_forward",
                    "msa_backward")
            mode = "+".join(m for m in (kl_value, precision) if m not in ("exact", "bf16"))
            name = f"/{mode}" if mode else ""
            extra = dict(info, kl_value=kl_value, select_precision=precision)
            self.measure(f"msa_func.fwd{name}", whole_fwd, ops_used=used[:2],
                         flops=main_forward_flops(nnz, self.D), selection="proxy top-K", extra=extra)
            self.measure(f"msa_func.fwd+bwd{name}", whole_fwd_bwd, ops_used=used,
                         flops=whole_fwd_bwd_flops(nnz, self.D), selection="proxy top-K", extra=extra)
        if self.args.skewed:
            skewed = skewed_block_indices(self.B, self.Hp, self.S, self.K, self.Bs, device=self.device)
            self._per_op("skewed", skewed, nnz_main(skewed, self.H, self.Bs), nnz_per_index_head(skewed, self.Bs))
        self.block_indices = None

    def _per_op(self, selection, block_indices, nnz, nnz_p):
        ops = torch.ops.flash_msa
        qp, kp, q, k, v = self.qp, self.kp, self.q, self.k, self.v
        info = dict(nnz=nnz, nnz_fraction_of_dense=nnz / dense_nnz(self.B, self.H, self.S), nnz_p=nnz_p,
                    proxy_kl_backward_flops=6 * self.Dp * nnz_p)
        saved = {}

        def forward():
            saved["fwd"] = ops.msa_forward(qp, kp, q, k, v, block_indices, self.Bs, self.scale, None)

        def backward():
            out, lse, lse_proxy, _ = saved["fwd"]
            return ops.msa_backward(qp, kp, q, k, v, out, lse, lse_proxy, block_indices, self.Bs, self.scale,
                                    self.dout, self.kl_grad, None)

        with torch.no_grad():
            row = self.measure("msa_forward", forward, ops_used=("msa_forward",),
                               flops=main_forward_flops(nnz, self.D), selection=selection, extra=info)
            if row["status"] == "ok":
                self.measure("msa_backward", backward, ops_used=("msa_backward",),
                             flops=main_backward_flops(nnz, self.D), selection=selection, extra=info)
            else:
                self._finish(dict(self.base("msa_backward", selection), backend=self.backends["msa_backward"],
                                  formula=FORMULAS["msa_backward"], **info),
                             status=f"skipped: needs msa_forward's outputs ({row['status']})")
        saved.clear()

    # --- warmup mode ---

    def warmup(self):
        from flash_msa_rt import flash_msa_warmup_func

        qp_g, kp_g, q_g, k_g, v_g = (t.detach().requires_grad_() for t in (self.qp, self.kp, self.q, self.k, self.v))
        dout = self.dout.view(self.B, self.S, self.H * self.D)

        flops = dense_forward_flops(self.B, self.H, self.S, self.D)
        for kl_value in self.args.kl_values:
            metric = torch.zeros((), device=self.device) if kl_value == "deferred" else None

            def fwd():
                return flash_msa_warmup_func(qp_g, kp_g, q_g, k_g, v_g, top_k=TOP_K, layout="bshd",
                                             kl_value=kl_value, kl_metric=metric, block_size=self.Bs)

            def fwd_bwd():
                out, kl_loss = fwd()
                return torch.autograd.grad((out, kl_loss), (qp_g, kp_g, q_g, k_g, v_g), (dout, self.kl_coef))

            name = "" if kl_value == "exact" else f"/{kl_value}"
            self.measure(f"warmup_func.fwd{name}", fwd, ops_used=("warmup_forward",), flops=flops,
                         selection="dense causal", extra=dict(kl_value=kl_value))
            self.measure(f"warmup_func.fwd+bwd{name}", fwd_bwd, ops_used=("warmup_forward", "warmup_backward"),
                         flops=3.5 * flops, selection="dense causal", extra=dict(kl_value=kl_value))

    # --- cuDNN dense baseline ---

    def dense(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        G = self.H // self.Hk
        # (B, H, S, D) views of the same (B, S, heads, D) tensors: cuDNN takes strided inputs.
        q = self.q.detach().transpose(1, 2).requires_grad_()
        k = self.k.detach().transpose(1, 2).requires_grad_()
        v = self.v.detach().transpose(1, 2).requires_grad_()
        dout = self.dout.transpose(1, 2)
        gqa = {"enable_gqa": True}
        how = "enable_gqa=True on (B, H, S, D) transposed views of the (B, S, heads, D) inputs (no copies)"
        try:  # forward and backward on a small problem of the same heads: does cuDNN take GQA?
            small = [torch.randn(1, h, 256, self.D, device=self.device, dtype=torch.bfloat16, requires_grad=True)
                     for h in (self.H, self.Hk, self.Hk)]
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.autograd.grad(sdpa(*small, is_causal=True, **gqa).sum(), small)
        except RuntimeError as e:  # cuDNN declines GQA here: give it MHA-shaped k/v, expanded outside the timing
            k = self.k.detach().repeat_interleave(G, dim=2).transpose(1, 2).requires_grad_()
            v = self.v.detach().repeat_interleave(G, dim=2).transpose(1, 2).requires_grad_()
            gqa = {}
            how = (f"k/v expanded to H heads before timing (repeat_interleave, not timed; cuDNN refused "
                   f"enable_gqa: {str(e).splitlines()[0][:200]})")

        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(q, k, v, is_causal=True, scale=self.scale, **gqa)

        def fwd_bwd():
            return torch.autograd.grad(fwd(), (q, k, v), dout)

        flops = dense_forward_flops(self.B, self.H, self.S, self.D)
        extra = dict(gqa=how)
        self.measure("cudnn_dense.fwd", fwd, flops=flops, selection="dense causal", backend="cudnn", extra=extra)
        self.measure("cudnn_dense.fwd+bwd", fwd_bwd, flops=3.5 * flops, selection="dense causal",
                     backend="cudnn", extra=extra)


def _bwd_tflops(fwd: dict | None, fwd_bwd: dict | None) -> float | None:
    """Effective TFLOP/s of a backward timed as fwd+bwd minus fwd: (fwd+bwd flops - fwd flops) / that time, i.e.
    10*D*nnz (or 10*D*dense nnz) over it, the fwd+bwd rows counting 3.5x the forward's 4*D*nnz."""
    if not (fwd and fwd_bwd and fwd.get("flops") and fwd_bwd.get("flops")) or fwd_bwd["ms"] <= fwd["ms"]:
        return None
    return tflops(fwd_bwd["flops"] - fwd["flops"], fwd_bwd["ms"] - fwd["ms"])


def mode_names(rows: list[dict]) -> list[str]:
    """The public op's modes measured: "exact" (bf16 selection, exact KL) and each "/<mode>" suffix
    (deferred, none, fp8, deferred+fp8, ...), exact first."""
    seen = {r["op"].split("/", 1)[1] if "/" in r["op"] else "exact" for r in rows
            if r["op"].startswith("msa_func.fwd+bwd")}
    return sorted(seen, key=lambda m: (m != "exact", m))


def primary_mode(comp: dict) -> str | None:
    """The mode a plot or the matrix's speedup uses: deferred (issue 53's) where measured, else exact, else the
    first with a speedup."""
    modes = comp.get("modes", {})
    for m in ("deferred", "exact", *modes):
        if modes.get(m, {}).get("x_dense"):
            return m
    return None


def comparisons(rows: list[dict]) -> list[dict]:
    """Per (config, B, S): the whole op fwd+bwd against cuDNN dense of this run and, for config (a) at B=1, against
    the published flash-msa 0.1.1 and FSA figures. "modes": per kl_value / select_precision mode of the public op,
    its fwd and fwd+bwd ms, speedup over dense (x_dense) and forward / backward effective TFLOP/s (FORMULAS'
    msa_func.fwd and msa_func.bwd); dense_fwd_tflops / dense_bwd_tflops beside them."""
    def get(cfg, B, S, op, selection=None):
        for r in rows:
            if (r["config"], r["B"], r["S"], r["op"]) == (cfg, B, S, op) and r["status"] == "ok" and \
                    (selection is None or r["selection"] == selection):
                return r
        return None

    out = []
    for cfg, B, S in sorted({(r["config"], r["B"], r["S"]) for r in rows}, key=lambda x: (x[0], x[2])):
        msa = get(cfg, B, S, "msa_func.fwd+bwd")
        dense = get(cfg, B, S, "cudnn_dense.fwd+bwd")
        warm = get(cfg, B, S, "warmup_func.fwd+bwd")
        warm_fwd, dense_fwd = get(cfg, B, S, "warmup_func.fwd"), get(cfg, B, S, "cudnn_dense.fwd")
        warm_d, warm_fwd_d = get(cfg, B, S, "warmup_func.fwd+bwd/deferred"), get(cfg, B, S, "warmup_func.fwd/deferred")
        modes = {}
        for mode in mode_names([r for r in rows if (r["config"], r["B"], r["S"]) == (cfg, B, S)]):
            suffix = "" if mode == "exact" else f"/{mode}"
            fb = get(cfg, B, S, f"msa_func.fwd+bwd{suffix}", "proxy top-K")
            f = get(cfg, B, S, f"msa_func.fwd{suffix}", "proxy top-K")
            modes[mode] = dict(msa_fwd_ms=f and f["ms"], msa_fwd_bwd_ms=fb and fb["ms"],
                               x_dense=dense["ms"] / fb["ms"] if fb and dense else None,
                               msa_fwd_tflops=f and f.get("tflops"), msa_bwd_tflops=_bwd_tflops(f, fb),
                               msa_fwd_bwd_tflops=fb and fb.get("tflops"),
                               msa_peak_mem_bytes=fb and fb.get("peak_mem_bytes"))
        c = dict(config=cfg, B=B, S=S, msa_fwd_bwd_ms=msa and msa["ms"], dense_fwd_bwd_ms=dense and dense["ms"],
                 warmup_fwd_bwd_ms=warm and warm["ms"],
                 x_dense=dense["ms"] / msa["ms"] if msa and dense else None,
                 warmup_x_dense=dense["ms"] / warm["ms"] if warm and dense else None,
                 # warmup time over cuDNN's, exact KL (issue 35's targets: forward <= 1.7, forward+backward <= 1.45)
                 warmup_fwd_over_dense=warm_fwd["ms"] / dense_fwd["ms"] if warm_fwd and dense_fwd else None,
                 warmup_fwd_bwd_over_dense=warm["ms"] / dense["ms"] if warm and dense else None,
                 # and deferred KL (targets: forward <= 1.2, forward+backward <= 1.35)
                 warmup_deferred_fwd_over_dense=warm_fwd_d["ms"] / dense_fwd["ms"] if warm_fwd_d and dense_fwd
                 else None,
                 warmup_deferred_fwd_bwd_over_dense=warm_d["ms"] / dense["ms"] if warm_d and dense else None,
                 msa_peak_mem_bytes=msa and msa["peak_mem_bytes"],
                 dense_peak_mem_bytes=dense and dense["peak_mem_bytes"],
                 # the median SM clock while each was timed (the card caps its power: common.ClockSamples)
                 msa_sm_clock_mhz=msa and msa.get("sm_clock_mhz"),
                 dense_sm_clock_mhz=dense and dense.get("sm_clock_mhz"),
                 dense_fwd_tflops=dense_fwd and dense_fwd.get("tflops"),
                 dense_bwd_tflops=_bwd_tflops(dense_fwd, dense), modes=modes)
        c["primary_mode"] = primary_mode(c)  # what plot_matrix.py draws: deferred where measured, else exact
        if cfg == PUBLISHED["shape"]["config"] and B == 1:
            pub = {}
            if S in PUBLISHED["flash_msa_0.1.1"]:
                f_fwd, f_fb = PUBLISHED["flash_msa_0.1.1"][S]
                d_fwd, d_fb = PUBLISHED["cudnn_dense"][S]
                pub.update(flash_msa_fwd_bwd_ms=f_fb, flash_msa_fwd_ms=f_fwd, flash_msa_x_dense=d_fb / f_fb,
                           cudnn_dense_fwd_bwd_ms=d_fb,
                           x_flash_msa=f_fb / msa["ms"] if msa else None,
                           this_run_dense_vs_published=d_fb / dense["ms"] if dense else None)
            if S in PUBLISHED["fsa_fwd_bwd"]:
                pub.update(fsa_fwd_bwd_ms=PUBLISHED["fsa_fwd_bwd"][S],
                           x_fsa=PUBLISHED["fsa_fwd_bwd"][S] / msa["ms"] if msa else None)
            if S in PUBLISHED["flash_msa_0.1.1_warmup"]:
                w_fwd, w_fb = PUBLISHED["flash_msa_0.1.1_warmup"][S]
                pub.update(flash_msa_warmup_fwd_bwd_ms=w_fb,
                           x_flash_msa_warmup=w_fb / warm["ms"] if warm else None)
            if pub:
                c["published"] = dict(pub, source=PUBLISHED["source"])
        out.append(c)
    return out


# --- output ------------------------------------------------------------------------------------------------------

def _fmt_ms(r):
    if r is None:
        return "-"
    if r["status"] != "ok":
        return "skip" if r["status"].startswith("skipped") else "err"
    t = f"{r['ms']:.2f}"
    return f"{t}/{r['tflops']:.0f}" if r.get("tflops") else t


def print_table(rows, comps):
    ops = ["select_blocks", "msa_forward", "msa_backward", "msa_func.fwd", "msa_func.fwd+bwd",
           "warmup_func.fwd+bwd", "cudnn_dense.fwd", "cudnn_dense.fwd+bwd"]
    heads = ["select", "fwd", "bwd", "op fwd", "op fwd+bwd", "warm f+b", "dense fwd", "dense f+b"]
    print("\nms/TFLOPS (effective, formulas above); 'skip' = reference backend skipped (see JSON status)")
    print(f"{'cfg':>3} {'B':>3} {'S':>6} " + " ".join(f"{h:>13}" for h in heads) + f" {'x dense':>8} "
          f"{'mem GB msa/dense':>17} {'MHz msa/dense':>14}")
    for c in comps:
        def get(op, sel=("proxy top-K", "dense causal", None)):
            return next((r for r in rows if (r["config"], r["B"], r["S"], r["op"]) == (c["config"], c["B"], c["S"], op)
                         and r["selection"] in sel), None)
        cells = " ".join(f"{_fmt_ms(get(op)):>13}" for op in ops)
        xd = f"{c['x_dense']:.2f}x" if c["x_dense"] else "-"
        mem = "/".join(f"{m / 2**30:.1f}" if m is not None else "-"
                       for m in (c["msa_peak_mem_bytes"], c["dense_peak_mem_bytes"]))
        mhz = "/".join(f"{m:.0f}" if m else "-" for m in (c.get("msa_sm_clock_mhz"), c.get("dense_sm_clock_mhz")))
        print(f"{c['config']:>3} {c['B']:>3} {c['S']:>6} {cells} {xd:>8} {mem:>17} {mhz:>14}")
    modes = sorted({r["op"].split("/")[1] for r in rows if "/" in r["op"]})
    for mode in modes:  # --kl-values: the public ops in the other modes, beside exact's
        print(f"\n{mode} (kl_value / select_precision; ms/TFLOPS; exact bf16's in the table above):")
        for c in comps:
            cells = []
            for op in ("select_blocks", "msa_func.fwd", "msa_func.fwd+bwd", "warmup_func.fwd", "warmup_func.fwd+bwd"):
                r = next((r for r in rows if (r["config"], r["B"], r["S"], r["op"]) ==
                          (c["config"], c["B"], c["S"], f"{op}/{mode}")), None)
                cells.append(f"{op} {_fmt_ms(r)}")
            print(f"{c['config']:>3} {c['B']:>3} {c['S']:>6} " + "   ".join(cells))
    skewed = [c for c in comps if any(r["selection"] == "skewed" and (r["config"], r["B"], r["S"]) ==
                                      (c["config"], c["B"], c["S"]) for r in rows)]
    if skewed:
        print("\nskewed selection (block 0 + its nearest blocks) against the proxy's top-K, per-op ms/TFLOPS:")
        print(f"{'cfg':>3} {'B':>3} {'S':>6} {'fwd top-K':>13} {'fwd skewed':>13} {'bwd top-K':>13} {'bwd skewed':>13}")
        for c in skewed:
            def get(op, sel):
                return next((r for r in rows if (r["config"], r["B"], r["S"], r["op"], r["selection"]) ==
                             (c["config"], c["B"], c["S"], op, sel)), None)
            cells = " ".join(f"{_fmt_ms(get(op, sel)):>13}" for op in ("msa_forward", "msa_backward")
                             for sel in ("proxy top-K", "skewed"))
            print(f"{c['config']:>3} {c['B']:>3} {c['S']:>6} {cells}")
    warm = [c for c in comps if c.get("warmup_fwd_over_dense") or c.get("warmup_fwd_bwd_over_dense")]
    if warm:
        print("\nwarmup mode's time over cuDNN dense attention's, same run (targets: exact fwd <= 1.7x, fwd+bwd <= "
              "1.45x; deferred fwd <= 1.2x, fwd+bwd <= 1.35x):")
        print(f"{'cfg':>3} {'B':>3} {'S':>6} {'fwd':>8} {'fwd+bwd':>8} {'deferred':>9} {'fwd+bwd':>8}")
        for c in warm:
            cells = " ".join(f"{c[k]:.2f}x".rjust(9 if k.startswith("warmup_deferred_fwd_over") else 8)
                             if c.get(k) else f"{'-':>8}"
                             for k in ("warmup_fwd_over_dense", "warmup_fwd_bwd_over_dense",
                                       "warmup_deferred_fwd_over_dense", "warmup_deferred_fwd_bwd_over_dense"))
            print(f"{c['config']:>3} {c['B']:>3} {c['S']:>6} {cells}")
    if any(c.get("modes") for c in comps):
        print("\nspeedup over cuDNN dense (dense fwd+bwd ms / op fwd+bwd ms) and effective TFLOP/s, op fwd / bwd "
              "(msa_func.fwd, msa_func.bwd formulas) and dense fwd / bwd (cudnn_dense.fwd, cudnn_dense.bwd):")
        print(f"{'cfg':>3} {'B':>3} {'S':>6} {'mode':>14} {'f+b ms':>8} {'x dense':>8} {'fwd TF':>7} {'bwd TF':>7} "
              f"{'dense fwd TF':>12} {'dense bwd TF':>12}")
        f = lambda x, spec: format(x, spec) if x is not None else "-"  # noqa: E731
        for c in comps:
            for mode, m in c.get("modes", {}).items():
                xd = f"{m['x_dense']:.2f}x" if m["x_dense"] else "-"
                print(f"{c['config']:>3} {c['B']:>3} {c['S']:>6} {mode:>14} {f(m['msa_fwd_bwd_ms'], '.2f'):>8} "
                      f"{xd:>8} {f(m['msa_fwd_tflops'], '.0f'):>7} {f(m['msa_bwd_tflops'], '.0f'):>7} "
                      f"{f(c.get('dense_fwd_tflops'), '.0f'):>12} {f(c.get('dense_bwd_tflops'), '.0f'):>12}")
    pubs = [c for c in comps if c.get("published")]
    if pubs:
        print(f"\nagainst figures {PUBLISHED['source']}:")
        print(f"{'S':>6} {'ours f+b':>9} {'flash-msa':>9} {'x flash-msa':>11} {'FSA':>6} {'x FSA':>6} "
              f"{'dense now/pub':>14}")
        for c in pubs:
            p = c["published"]
            f = lambda x, spec: format(x, spec) if x is not None else "-"  # noqa: E731
            print(f"{c['S']:>6} {f(c['msa_fwd_bwd_ms'], '9.2f'):>9} {f(p.get('flash_msa_fwd_bwd_ms'), '9.1f'):>9} "
                  f"{f(p.get('x_flash_msa'), '10.2f'):>11} {f(p.get('fsa_fwd_bwd_ms'), '6.1f'):>6} "
                  f"{f(p.get('x_fsa'), '6.2f'):>6} "
                  f"{f(c['dense_fwd_bwd_ms'], '.2f')}/{f(p.get('cudnn_dense_fwd_bwd_ms'), '.2f'):>7}")
    backends = {}
    for r in rows:
        b = r["backend"]
        for o, name in (b.items() if isinstance(b, dict) else [(r["op"], b)]):
            backends.setdefault(o, set()).add(name)
    print("\nbackends: " + ", ".join(f"{o}={'/'.join(sorted(n))}" for o, n in backends.items()))


def write_json(path: Path, payload: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=1, default=str) + "\n"
    path.write_text(text)
    out = os.environ.get("OUT")  # the GPU machine's folder that comes back
    if out:
        Path(out, path.name).write_text(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_msa: no CUDA device is available (torch.cuda.is_available() is False); this benchmark needs "
              "an NVIDIA GPU (the H200 of docs/h200.md).", file=sys.stderr)
        return 2

    rows: list[dict] = []
    caught: list[str] = []
    timer, guard = Timer(args), ReferenceGuard()
    payload = dict(
        benchmark="msa", commit=commit(), device=torch.cuda.get_device_name(), torch=torch.__version__,
        cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv[1:] if argv is None else list(argv),
        settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        shape=shape_record(args),
        formulas=FORMULAS,
        method=("CUDA events; --warmup untimed calls, then the median of --reps timed calls (fewer when the calls "
                "would exceed --budget-seconds); the L2 is flushed (256 MB zeroed) before every timed call, "
                "outside the events; inputs random normal (std 1, bf16) after torch.manual_seed(seed); forward "
                "timings of the public ops and dense run with autograd enabled (the training forward); per-op "
                "rows call torch.ops.flash_msa.* under no_grad; peak_mem_bytes = max_memory_allocated during the "
                "first call minus memory_allocated before it (outputs, saved tensors, gradients, workspace; not "
                "the inputs); sm_clock_mhz / power_w: medians of nvidia-smi samples every 20 ms during the timed calls "
                "(the H200 caps its power at 700 W and lowers its clock under long heavy runs)"),
        published=PUBLISHED, rows=rows, comparisons=[], dispatch_warnings=caught)
    print("effective TFLOPS formulas (msa-semantics.md):")
    for k, v in FORMULAS.items():
        print(f"  {k}: {v}")
    print(f"shape: D={args.head_dim}, Dp={args.proxy_head_dim} (b64: 64), Bs={args.block_size}, top_k={TOP_K} "
          f"tokens = K {TOP_K // args.block_size} blocks, bf16" + (f", tag {args.tag}" if args.tag else ""))
    print(f"{payload['device']}, torch {torch.__version__}, commit {payload['commit'][:12]}")

    for name in args.configs:
        for S in args.seqlens:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                case = Case(name, args, S, timer, guard, rows)
                t0 = time.perf_counter()
                for mode in args.ops:
                    getattr(case, mode)()
                caught.extend(str(x.message) for x in w if str(x.message) not in caught)
            del case
            torch.cuda.empty_cache()
            done = [r for r in rows if (r["config"], r["S"]) == (name, S)]
            print(f"[{name} S={S} B={batch_of(args, S)}: {len(done)} rows, {time.perf_counter() - t0:.1f} s]",
                  flush=True)
            payload["comparisons"] = comparisons(rows)
            write_json(args.out, payload)  # after every case, so a cut run keeps what it measured
    for msg in caught:
        print(f"dispatch: {msg}")
    print_table(rows, payload["comparisons"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
