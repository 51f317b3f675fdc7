"""Packed sequences on the kernels (issue 34): the same 128K tokens per step as packs (flash_msa_varlen_func) and as a
fixed batch (flash_msa_func), and through cuDNN dense attention one document at a time, in one run.

(i) equal-length packs (16 x 8K, 4 x 32K, 2 x 64K) against the fixed batch of the same shape, forward and
forward + backward; (ii) a realistic mix: document lengths drawn log-uniformly in [512, 65536] (seed 0) until 128K
tokens (the last one cut to fit), its effective TFLOPS (3.5 x 4 D nnz of its own selection, the peer-table
convention of bench_msa) beside the fixed batch's at the length in 8K..64K nearest the mix's token-weighted mean
length (19.5K for seed 0: 16K);
(iii) dense: torch SDPA (cuDNN) per document, forward + backward; (iv) warmup mode on the equal-length packs against
its fixed batch. Configurations of docs/kernel-notes.md.

Run:  FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_packed.py --out benchmarks/results/packed.json
Plot: python benchmarks/bench_packed.py --plot benchmarks/results/packed.json   (CPU machine, matplotlib)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_msa import BLOCK, CONFIGS, D, DP, TOP_K, nnz_main  # noqa: E402
from benchmarks.common import commit, cuda_time_ms  # noqa: E402
from flash_msa_rt import tuning  # noqa: E402
from flash_msa_rt.ops import packed  # noqa: E402

TOKENS = 128 * 1024
EQUAL = (8192, 32768, 65536)
FIXED = (8192, 16384, 32768, 65536)  # the mix is compared with the fixed length nearest its token-weighted mean
FORMULA = "effective TFLOPS = 3.5 * 4 * D * nnz / time (nnz: the causal keys of each row's selected blocks, per head)"


def short_mix(seed: int = 0, total: int = TOKENS) -> list[int]:
    """One 65536-token document, then documents of log-uniform length in [128, 1024] until `total` tokens."""
    g = random.Random(seed)
    lengths = [65536]
    while sum(lengths) < total:
        lengths.append(min(int(round(math.exp(g.uniform(math.log(128), math.log(1024))))), total - sum(lengths)))
    return lengths


def mix_lengths(seed: int = 0, lo: int = 512, hi: int = 65536, total: int = TOKENS) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < total:
        u = float(torch.rand((), generator=g))
        out.append(int(round(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


class Case:
    def __init__(self, cfg: str, args):
        self.cfg, self.args = cfg, args
        self.H, self.Hk, self.Hp, self.Hpk = CONFIGS[cfg]
        g = torch.Generator(device="cuda").manual_seed(args.seed)
        rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
        heads = (self.Hp, self.Hpk, self.H, self.Hk, self.Hk)
        dims = (DP, DP, D, D, D)
        self.flat = [rnd(TOKENS, h, d).requires_grad_() for h, d in zip(heads, dims)]
        self.dout = rnd(TOKENS, self.H, D)
        self.kl_coef = torch.tensor(0.1, device="cuda")

    def time(self, fn):
        return cuda_time_ms(fn, self.args.warmup, self.args.reps)

    def fixed(self, L: int) -> dict:
        import flash_msa_rt as F
        import flash_msa_rt.ops.library  # noqa: F401 - registers torch.ops.flash_msa

        B = TOKENS // L
        x = [t.detach().view(B, L, *t.shape[1:]).requires_grad_() for t in self.flat]
        dout = self.dout.view(B, L, self.H * D)

        def fwd():
            return F.flash_msa_func(*x, top_k=TOP_K, layout="bshd")

        def fwd_bwd():
            out, kl = fwd()
            torch.autograd.grad((out, kl), x, (dout, self.kl_coef))

        sel = torch.ops.flash_msa.select_blocks(x[0], x[1], TOP_K // BLOCK, BLOCK, D ** -0.5, None)
        nnz = nnz_main(sel, self.H)
        with torch.no_grad():
            f = self.time(fwd)
        fb = self.time(fwd_bwd)
        return dict(B=B, L=L, fwd_ms=f, fwd_bwd_ms=fb, nnz=nnz, tflops=3.5 * 4 * D * nnz / (fb * 1e-3) / 1e12)

    def packed(self, lengths: list[int]) -> dict:
        import flash_msa_rt as F
        import flash_msa_rt.ops.library  # noqa: F401 - registers torch.ops.flash_msa
        from flash_msa_rt.selftest import resolved_backends
        from flash_msa_rt.selftest.backends import backend_text

        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        x = [t.detach().requires_grad_() for t in self.flat]
        longest = max(lengths)

        def fwd():
            return F.flash_msa_varlen_func(*x, cu, longest, TOP_K)

        def fwd_bwd():
            out, kl = fwd()
            torch.autograd.grad((out, kl), x, (self.dout, self.kl_coef))

        sel = torch.ops.flash_msa.select_blocks(x[0][None], x[1][None], TOP_K // BLOCK, BLOCK, D ** -0.5, cu)
        bounds = cu.tolist()
        nnz = sum(nnz_main(sel[:, :, a:b], self.H) for a, b in zip(bounds[:-1], bounds[1:]) if b > a)
        with resolved_backends() as seen:
            fwd_bwd()
        backend = backend_text(seen, ("select_blocks", "msa_forward", "msa_backward"))
        with torch.no_grad():
            f = self.time(fwd)
        fb = self.time(fwd_bwd)
        return dict(documents=len(lengths), lengths=lengths, fwd_ms=f, fwd_bwd_ms=fb, nnz=nnz,
                    tflops=3.5 * 4 * D * nnz / (fb * 1e-3) / 1e12, backend=backend)

    def warmup(self, L: int) -> dict:
        """Warmup mode (dense main attention, the proxy trained over every causal key) on 128K tokens as TOKENS // L
        documents of L: the fixed batch (flash_msa_warmup_func) against the pack (flash_msa_warmup_varlen_func)."""
        import flash_msa_rt as F

        B = TOKENS // L
        cu = torch.arange(0, TOKENS + 1, L, dtype=torch.int32, device="cuda")
        fixed = [t.detach().view(B, L, *t.shape[1:]).requires_grad_() for t in self.flat]
        flat = [t.detach().requires_grad_() for t in self.flat]
        calls = {"fixed": (lambda: F.flash_msa_warmup_func(*fixed, TOP_K, layout="bshd"), fixed,
                           self.dout.view(B, L, self.H * D)),
                 "packed": (lambda: F.flash_msa_warmup_varlen_func(*flat, cu, L, TOP_K), flat, self.dout)}
        out = {}
        for name, (fwd, leaves, dout) in calls.items():
            def fwd_bwd(fwd=fwd, leaves=leaves, dout=dout):
                o, kl = fwd()
                torch.autograd.grad((o, kl), leaves, (dout.reshape(o.shape), self.kl_coef))

            with torch.no_grad():
                f = self.time(fwd)
            out[name] = dict(fwd_ms=f, fwd_bwd_ms=self.time(fwd_bwd))
        return out

    def dense(self, lengths: list[int]) -> dict:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        q, k, v = (t.detach() for t in self.flat[2:])
        spans, at = [], 0
        for n in lengths:
            spans.append((at, at + n))
            at += n

        def fwd_bwd():
            for a, b in spans:
                qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v))
                out = sdpa(qs, ks, vs, is_causal=True, enable_gqa=True)
                torch.autograd.grad(out, (qs, ks, vs), self.dout[a:b].transpose(0, 1).unsqueeze(0))

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            fb = self.time(fwd_bwd)
        return dict(fwd_bwd_ms=fb, how="torch SDPA on cuDNN, one call per document (this torch has no varlen "
                                       "SDPA that returns the lse), enable_gqa")


def run(args) -> dict:
    rows = []
    for cfg in args.configs:
        case = Case(cfg, args)
        fixed = {L: case.fixed(L) for L in FIXED}
        for L in EQUAL:
            lengths = [L] * (TOKENS // L)
            p = case.packed(lengths)
            d = case.dense(lengths)
            f = fixed[L]
            rows.append(dict(config=cfg, kind="equal", pack=f"{len(lengths)} x {L}", fixed=f, packed=p, dense=d,
                             packed_over_fixed_fwd=p["fwd_ms"] / f["fwd_ms"],
                             packed_over_fixed_fwd_bwd=p["fwd_bwd_ms"] / f["fwd_bwd_ms"],
                             x_dense=d["fwd_bwd_ms"] / p["fwd_bwd_ms"]))
            print(f"{cfg} {rows[-1]['pack']:>10}: fixed {f['fwd_ms']:.2f}/{f['fwd_bwd_ms']:.2f} ms, packed "
                  f"{p['fwd_ms']:.2f}/{p['fwd_bwd_ms']:.2f} ms (fwd {rows[-1]['packed_over_fixed_fwd']:.2f}x, "
                  f"fwd+bwd {rows[-1]['packed_over_fixed_fwd_bwd']:.2f}x; target <= 1.10x), dense per doc "
                  f"{d['fwd_bwd_ms']:.1f} ms ({rows[-1]['x_dense']:.2f}x)", flush=True)
        for L in EQUAL:
            w = case.warmup(L)
            f, p = w["fixed"], w["packed"]
            rows.append(dict(config=cfg, kind="warmup", pack=f"{TOKENS // L} x {L}", fixed=f, packed=p,
                             packed_over_fixed_fwd=p["fwd_ms"] / f["fwd_ms"],
                             packed_over_fixed_fwd_bwd=p["fwd_bwd_ms"] / f["fwd_bwd_ms"]))
            print(f"{cfg} warmup {rows[-1]['pack']:>10}: fixed {f['fwd_ms']:.2f}/{f['fwd_bwd_ms']:.2f} ms, packed "
                  f"{p['fwd_ms']:.2f}/{p['fwd_bwd_ms']:.2f} ms (fwd {rows[-1]['packed_over_fixed_fwd']:.2f}x, "
                  f"fwd+bwd {rows[-1]['packed_over_fixed_fwd_bwd']:.2f}x; target <= 1.10x)", flush=True)
        lengths = mix_lengths(args.seed)
        weighted = sum(n * n for n in lengths) / sum(lengths)
        p, d = case.packed(lengths), case.dense(lengths)
        ref = fixed[min(FIXED, key=lambda L: abs(math.log(L / weighted)))]
        rows.append(dict(config=cfg, kind="mix", pack=f"{len(lengths)} documents, log-uniform 512..65536",
                         token_weighted_mean_length=weighted, packed=p, dense=d, fixed_at=ref,
                         tflops_fraction_of_fixed=p["tflops"] / ref["tflops"],
                         x_dense=d["fwd_bwd_ms"] / p["fwd_bwd_ms"]))
        print(f"{cfg} mix of {len(lengths)} documents (token-weighted mean {weighted:.0f}): packed "
              f"{p['fwd_bwd_ms']:.2f} ms, {p['tflops']:.0f} TFLOPS = {rows[-1]['tflops_fraction_of_fixed']:.0%} of "
              f"the fixed batch at {ref['L']} ({ref['tflops']:.0f}; target >= 85%); dense per doc {d['fwd_bwd_ms']:.1f} ms "
              f"({rows[-1]['x_dense']:.2f}x)", flush=True)
        # (iii) issue 34's load-balance case: one 64K document beside hundreds of short ones of different lengths,
        # which packed.batches pads into a few calls (the calls are counted beside the time).
        lengths = short_mix(args.seed)
        p, d = case.packed(lengths), case.dense(lengths)
        spans = packed.sequence_spans(torch.tensor([0, *itertools.accumulate(lengths)]))
        policy = tuning.packed.choose("sm90a")
        calls = len(packed.batches(spans, True, policy.call_pairs, policy.merge_max_length))
        rows.append(dict(config=cfg, kind="short", pack=f"65536 + {len(lengths) - 1} documents of 128..1024",
                         packed=p, dense=d, calls_per_op=calls, x_dense=d["fwd_bwd_ms"] / p["fwd_bwd_ms"]))
        print(f"{cfg} one 64K document + {len(lengths) - 1} short ones: packed {p['fwd_ms']:.2f}/{p['fwd_bwd_ms']:.2f} ms "
              f"in {calls} calls per op, {p['tflops']:.0f} TFLOPS; dense per doc {d['fwd_bwd_ms']:.1f} ms "
              f"({rows[-1]['x_dense']:.2f}x)", flush=True)
    return dict(benchmark="packed sequences against the fixed batch and dense attention", commit=commit(),
                device=torch.cuda.get_device_name(), torch=torch.__version__, tokens_per_step=TOKENS,
                top_k=TOP_K, D=D, Dp=DP, dtype="bf16", formula=FORMULA, configs={c: CONFIGS[c] for c in args.configs},
                method="median of --reps CUDA-event timings after --warmup calls; packed: flash_msa_varlen_func "
                       "(kernels one sequence at a time), fixed: flash_msa_func layout bshd", rows=rows,
                when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    rows = data["rows"]
    configs = list(data["configs"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    labels = sorted({r["pack"] for r in rows if r["kind"] == "equal"}, key=lambda s: int(s.split(" x ")[1]))
    width = 0.8 / len(configs)
    for n, cfg in enumerate(configs):
        vals = [next(r["packed_over_fixed_fwd_bwd"] for r in rows if r["config"] == cfg and r["pack"] == lab)
                for lab in labels]
        ax.bar([i + n * width for i in range(len(labels))], vals, width, label=f"({cfg})")
    ax.axhline(1.10, color="k", ls="--", lw=1, label="target 1.10x")
    ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("packed / fixed batch, fwd+bwd time")
    ax.set_title("equal-length packs, 128K tokens", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    mixes = [r for r in rows if r["kind"] == "mix"]
    ax.bar([f"({r['config']}) mix" for r in mixes], [r["packed"]["tflops"] for r in mixes], label="mix, packed")
    ax.bar([f"({r['config']}) {r['fixed_at']['L'] // 1024}K" for r in mixes], [r["fixed_at"]["tflops"] for r in mixes],
           label="fixed batch near the mix's mean length")
    ax.set_ylabel("effective TFLOPS (fwd+bwd)")
    ax.set_title("realistic mix vs the fixed length near its mean", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"flash-msa packed sequences, {data['device']}, commit {data['commit']}", fontsize=10)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="a,b,c", type=lambda s: s.split(","))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="draw the PNG of a results JSON and exit (no GPU needed)")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
