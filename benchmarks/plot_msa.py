"""Plot a bench_msa.py JSON: per configuration, time against S (log-log: cuDNN dense and the MSA op, forward+backward
and forward) and the speed of the MSA op relative to dense (dense ms / MSA ms). Runs on the CPU machine.

    python benchmarks/plot_msa.py benchmarks/results/msa.json            # -> benchmarks/results/msa.png
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

LINES = [  # op, label, style
    ("cudnn_dense.fwd+bwd", "cuDNN dense fwd+bwd", dict(color="black", marker="o")),
    ("msa_func.fwd+bwd", "flash_msa_func fwd+bwd", dict(color="tab:red", marker="o")),
    ("msa_func.fwd+bwd/deferred", "flash_msa_func fwd+bwd, deferred KL", dict(color="tab:orange", marker="o")),
    ("warmup_func.fwd+bwd", "warmup fwd+bwd", dict(color="tab:purple", marker="s")),
    ("cudnn_dense.fwd", "cuDNN dense fwd", dict(color="black", marker="o", ls=":")),
    ("msa_func.fwd", "flash_msa_func fwd", dict(color="tab:red", marker="o", ls=":")),
]


def series(rows, config, op, selection=None):
    """[(S, ms)] of the measured rows (skipped ones left out), sorted by S."""
    pts = [(r["S"], r["ms"]) for r in rows if r["config"] == config and r["op"] == op and r["status"] == "ok"
           and (selection is None or r["selection"] == selection)]
    return sorted(pts)


def _legend(ax):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best", framealpha=0.6)


def plot(data: dict, out: Path) -> Path:
    rows, comps = data["rows"], data.get("comparisons", [])
    configs = sorted({r["config"] for r in rows})
    fig, axes = plt.subplots(2, max(1, len(configs)), figsize=(max(7.0, 5.2 * len(configs)), 8), squeeze=False,
                             sharex="col", gridspec_kw={"height_ratios": [3, 2]})
    shapes = data.get("shape", {}).get("configs", {})
    published = data.get("published", {})
    for col, cfg in enumerate(configs):
        top, bottom = axes[0][col], axes[1][col]
        batches = sorted({r["B"] for r in rows if r["config"] == cfg})
        for op, label, style in LINES:
            pts = series(rows, cfg, op, "proxy top-K" if op.startswith("msa_func") else None)
            if pts:
                top.plot(*zip(*pts), label=label, **style)
        b1 = batches == [1]
        if b1 and cfg == published.get("shape", {}).get("config"):
            for key, label, style in (("flash_msa_0.1.1", "flash-msa 0.1.1 fwd+bwd (published)", "x--"),
                                      ("cudnn_dense", "cuDNN fwd+bwd (published)", "+--")):
                pts = sorted((int(s), v[1]) for s, v in published.get(key, {}).items())
                if pts:
                    top.plot(*zip(*pts), style, color="gray", label=label)
            pts = sorted((int(s), v) for s, v in published.get("fsa_fwd_bwd", {}).items())
            if pts:
                top.plot(*zip(*pts), "^--", color="tab:green", label="FSA fwd+bwd (published)")
        top.set_yscale("log")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda s, _: f"{s / 1024:g}K"))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
            ax.grid(True, which="both", alpha=0.3)
        top.set_ylabel("ms per call (median)")
        heads = shapes.get(cfg, {})
        head_text = ", ".join(f"{k}={v}" for k, v in heads.items())
        top.set_title(f"config ({cfg}) {head_text}\n" + ("B=1" if b1 else "B = tokens // S"), fontsize=9)
        _legend(top)

        pts = sorted((c["S"], c["x_dense"]) for c in comps if c["config"] == cfg and c.get("x_dense"))
        if pts:
            bottom.plot(*zip(*pts), "o-", color="tab:red", label="flash_msa_func vs cuDNN (fwd+bwd)")
        pts = sorted((c["S"], c["modes"]["deferred"]["x_dense"]) for c in comps if c["config"] == cfg
                     and ((c.get("modes") or {}).get("deferred") or {}).get("x_dense"))
        if pts:
            bottom.plot(*zip(*pts), "o--", color="tab:orange", label="flash_msa_func deferred KL vs cuDNN (fwd+bwd)")
        pts = sorted((c["S"], c["warmup_x_dense"]) for c in comps if c["config"] == cfg and c.get("warmup_x_dense"))
        if pts:
            bottom.plot(*zip(*pts), "s-", color="tab:purple", label="warmup vs cuDNN (fwd+bwd)")
        pub = sorted((c["S"], c["published"]["flash_msa_x_dense"]) for c in comps
                     if c["config"] == cfg and c.get("published", {}).get("flash_msa_x_dense"))
        if pub:
            bottom.plot(*zip(*pub), "x--", color="gray", label="flash-msa 0.1.1 vs cuDNN (published)")
        bottom.axhline(1.0, color="black", lw=0.8)
        if not any(c["config"] == cfg and (c.get("x_dense") or c.get("primary_mode")) for c in comps):
            bottom.text(0.5, 0.5, "no MSA fwd+bwd measured in this run\n(see the rows' status in the JSON)",
                        transform=bottom.transAxes, ha="center", va="center", fontsize=8, color="gray")
        bottom.set_xlabel("sequence length S")
        bottom.set_ylabel("speed vs dense (dense ms / ms)")
        _legend(bottom)
    dims = data.get("shape", {})
    fig.suptitle(f"MSA whole op vs cuDNN dense (bf16, D={dims.get('D', 128)}, Bs={dims.get('block_size', 128)}, "
                 f"top_k 2048)\n{data.get('device', '?')}, torch "
                 f"{data.get('torch', '?')}, commit {str(data.get('commit', '?'))[:10]}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path, nargs="?", default=RESULTS / "msa.json", help="bench_msa.py output")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default: the JSON's name under results/)")
    args = p.parse_args(argv)
    out = args.out or RESULTS / (args.json.stem + ".png")
    print(f"wrote {plot(json.loads(args.json.read_text()), out)}")


if __name__ == "__main__":
    main()
