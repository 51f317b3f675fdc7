"""Plot benchmarks/results/block_scores.json: TFLOP/s against sequence length, with the 770 TFLOP/s ceiling."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    data = json.loads((RESULTS / "block_scores.json").read_text())
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for dp in sorted({r["Dp"] for r in data["rows"]}):
        rows = sorted((r for r in data["rows"] if r["Dp"] == dp), key=lambda r: r["S"])
        ax.plot([r["S"] for r in rows], [r["tflops"] for r in rows], "o-", label=f"proxy_block_scores, Dp={dp}")
    ax.axhline(770, color="gray", ls="--", label="bf16 ceiling (cuBLAS-class GEMM, 770 TFLOP/s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length S (B=1, Hp=4, Hpk=1)")
    ax.set_ylabel(f"TFLOP/s  ({data['formula']})")
    ax.set_ylim(0, 820)
    ax.set_title(f"{data['device']}, commit {data['commit'][:8]}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = RESULTS / "block_scores.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
