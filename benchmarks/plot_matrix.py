"""Plot several bench_msa.py JSON files, one configuration (D, Dp, Bs) each (issue 53's matrix), in one figure:
the whole op's speedup over cuDNN dense fwd+bwd against S (left), and its forward / backward effective TFLOP/s
(right, FORMULAS' msa_func.fwd and msa_func.bwd). Each file's public-op mode is deferred KL where measured, else
exact (bench_msa.primary_mode). Prints a table; with --baseline (the D 128 / Bs 128 file of the same session) also
each speedup as a share of the baseline's at the same configuration and S, and draws 85 % of the baseline.

    python benchmarks/plot_matrix.py benchmarks/results/msa_matrix_*.json \\
        --baseline benchmarks/results/msa_matrix_d128_b128.json        # -> benchmarks/results/matrix.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.85  # issue 53: each new head dim at Bs 128 reaches 85 % of the D 128 / Bs 128 op's speedup


def label_of(data: dict) -> str:
    """"D=64 Dp=64 Bs=128" from the JSON's shape (D = Dp = Bs = 128 for files written before the options)."""
    s = data.get("shape", {})
    return f"D={s.get('D', 128)} Dp={s.get('Dp', 128)} Bs={s.get('block_size', 128)}"


def _mode(c: dict) -> str | None:
    modes = c.get("modes") or {}
    for m in ("deferred", "exact", *modes):
        if (modes.get(m) or {}).get("x_dense"):
            return m
    return "exact" if c.get("x_dense") else None  # a JSON from before "modes"


def points(data: dict) -> dict[str, list[dict]]:
    """config -> [{S, B, mode, x_dense, fwd_tflops, bwd_tflops, fwd_bwd_ms, dense_fwd_bwd_ms}] sorted by S."""
    out: dict[str, list[dict]] = {}
    for c in data.get("comparisons", []):
        mode = c.get("primary_mode") or _mode(c)
        if mode is None:
            continue
        m = (c.get("modes") or {}).get(mode) or dict(x_dense=c.get("x_dense"), msa_fwd_bwd_ms=c.get("msa_fwd_bwd_ms"))
        out.setdefault(c["config"], []).append(dict(
            S=c["S"], B=c["B"], mode=mode, x_dense=m.get("x_dense"), fwd_tflops=m.get("msa_fwd_tflops"),
            bwd_tflops=m.get("msa_bwd_tflops"), fwd_bwd_ms=m.get("msa_fwd_bwd_ms"),
            dense_fwd_bwd_ms=c.get("dense_fwd_bwd_ms")))
    return {k: sorted(v, key=lambda p: p["S"]) for k, v in out.items()}


def table(files: list[tuple[str, dict]], baseline: dict | None) -> list[str]:
    base = points(baseline) if baseline else {}
    f = lambda x, spec: format(x, spec) if x is not None else "-"  # noqa: E731
    lines = [f"{'configuration':<22} {'cfg':>3} {'B':>3} {'S':>7} {'mode':>9} {'op f+b ms':>9} {'dense ms':>9} "
             f"{'x dense':>8} {'fwd TF':>7} {'bwd TF':>7}" + (f" {'of base':>8}" if baseline else "")]
    for label, data in files:
        for cfg, pts in points(data).items():
            for p in pts:
                ref = next((q for q in base.get(cfg, []) if q["S"] == p["S"] and q["x_dense"]), None)
                share = f"{100 * p['x_dense'] / ref['x_dense']:.0f}%" if ref and p["x_dense"] else "-"
                lines.append(f"{label:<22} {cfg:>3} {p['B']:>3} {p['S']:>7} {p['mode']:>9} "
                             f"{f(p['fwd_bwd_ms'], '.2f'):>9} {f(p['dense_fwd_bwd_ms'], '.2f'):>9} "
                             f"{f(p['x_dense'], '.2f') + 'x':>8} {f(p['fwd_tflops'], '.0f'):>7} "
                             f"{f(p['bwd_tflops'], '.0f'):>7}" + (f" {share:>8}" if baseline else ""))
    return lines


def plot(files: list[tuple[str, dict]], out: Path, baseline: dict | None = None) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    n = 0
    for label, data in files:
        for cfg, pts in points(data).items():
            color = colors[n % len(colors)]
            n += 1
            name = f"{label} ({cfg}, {pts[0]['mode']})"
            xs = [(p["S"], p["x_dense"]) for p in pts if p["x_dense"]]
            if xs:
                left.plot(*zip(*xs), "o-", color=color, label=name)
            for key, style, what in (("fwd_tflops", "o-", "fwd"), ("bwd_tflops", "s--", "bwd")):
                ts = [(p["S"], p[key]) for p in pts if p[key]]
                if ts:
                    right.plot(*zip(*ts), style, color=color, label=f"{name} {what}")
    if baseline:
        for cfg, pts in points(baseline).items():
            xs = [(p["S"], TARGET * p["x_dense"]) for p in pts if p["x_dense"]]
            if xs:
                left.plot(*zip(*xs), ":", color="gray", label=f"{TARGET:.0%} of {label_of(baseline)} ({cfg})")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda s, _: f"{s / 1024:g}K"))
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("sequence length S (B = tokens // S)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best", framealpha=0.6)
    left.axhline(1.0, color="black", lw=0.8)
    left.set_ylabel("speedup: cuDNN dense fwd+bwd ms / MSA op fwd+bwd ms")
    right.set_ylabel("MSA op effective TFLOP/s (fwd 4*D*nnz; bwd 10*D*nnz over f+b - f)")
    left.set_title("whole op vs cuDNN dense at the same D", fontsize=9)
    right.set_title("forward (solid) and backward (dashed)", fontsize=9)
    first = files[0][1] if files else {}
    fig.suptitle(f"MSA head-dim / key-block matrix (bf16, top_k 2048 tokens)\n{first.get('device', '?')}, commit "
                 f"{str(first.get('commit', '?'))[:10]}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path, nargs="+", help="bench_msa.py outputs, one configuration each")
    p.add_argument("--baseline", type=Path, default=None,
                   help="the D 128 / Bs 128 JSON: the table's 'of base' and the 85 %% line")
    p.add_argument("--out", type=Path, default=RESULTS / "matrix.png", help="PNG path")
    args = p.parse_args(argv)
    files = [(label_of(d), d) for d in (json.loads(f.read_text()) for f in args.json)]
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    print("\n".join(table(files, baseline)))
    print(f"wrote {plot(files, args.out, baseline)}")


if __name__ == "__main__":
    main()
