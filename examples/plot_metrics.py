"""Plot a metrics JSON written by train_msa.py: loss, KL, proxy recall and throughput, MSA against dense.

    python examples/plot_metrics.py runs/msa/metrics.json [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLORS = {"msa": "tab:blue", "dense": "tab:orange"}


def _ema(values: list[float], alpha: float = 0.1) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def plot(metrics: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = metrics["runs"]
    warmup = metrics["config"]["warmup_steps"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax_loss, ax_kl, ax_recall, ax_tps = axes.flat

    for name, run in runs.items():
        h, c = run["history"], COLORS.get(name)
        ax_loss.plot(h["step"], h["lm_loss"], color=c, alpha=0.35, lw=0.8, label=f"{name} train (raw, per step)")
        ax_loss.plot(h["step"], _ema(h["lm_loss"]), color=c, label=f"{name} train (EMA)")
        if run["val"]["step"]:
            ax_loss.plot(run["val"]["step"], run["val"]["val_loss"], "o--", color=c, ms=4, label=f"{name} val")
        ax_tps.plot(h["step"], h["tokens_per_s"], color=c, label=name, lw=0.8)
        if any(v is not None for v in h["kl"]):
            steps = [s for s, v in zip(h["step"], h["kl"]) if v is not None]
            ax_kl.plot(steps, [v for v in h["kl"] if v is not None], color=c, label=f"{name} proxy KL")
        if run["recall"]["step"]:
            r = run["recall"]
            ax_recall.plot(r["step"], r["recall"], "o-", color=c, ms=3, label=f"{name} recall")
            ax_recall.plot(r["step"], r["coverage"], ":", color=c, label=f"{name} coverage (uniform attention)")

    for ax in axes.flat:
        if warmup:
            ax.axvline(warmup, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_loss.set_ylabel("LM loss (nats / byte)")
    ax_loss.set_title("loss (dashed line: end of MSA warmup)")
    ax_kl.set_ylabel("KL(main || proxy), mean over layers")
    # The target is the main heads' attention, which starts near uniform (as does the proxy: KL ~ 0) and sharpens
    # as the model learns; the proxy chases it, so the KL rises, then settles. Recall, not KL, scores the selection.
    ax_kl.set_title("proxy KL: rises as the main heads' attention sharpens from uniform", fontsize=10)
    if ax_kl.has_data():
        ax_kl.set_yscale("log")
    ax_recall.set_ylabel("share of main attention mass kept")
    ax_recall.set_title("proxy recall on sampled queries")
    ax_recall.set_ylim(0, 1.02)
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_title(f"throughput (MSA on {metrics.get('msa_backend') or '?'})")
    if metrics.get("msa_backend") == "reference":
        ax_tps.text(0.02, 0.02, "MSA ran on the pure-PyTorch reference: slow by design,\nnot the kernels' speed",
                    transform=ax_tps.transAxes, fontsize=8, va="bottom", color="tab:blue")
    cfg = metrics["config"]
    fig.suptitle(f"MSA ({metrics.get('msa_backend') or '?'}) vs dense, {metrics.get('device', '?')}: "
                 f"S={cfg['seq_len']}, block={cfg['block_size']}, "
                 f"top_k={cfg['top_k']}, commit {str(metrics.get('commit', '?'))[:10]}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(__doc__)
    src = Path(argv[0])
    dst = Path(argv[1]) if len(argv) > 1 else src.with_suffix(".png")
    print(plot(json.loads(src.read_text()), dst))


if __name__ == "__main__":
    main()
