"""The million-token picture from committed results (no GPU): configuration (b), forward + backward of the whole
op (deferred KL) with bf16 and fp8 selection against S, beside cuDNN dense attention, and peak memory beside
dense's.

Time: benchmarks/results/msa_fp8.json (128K tokens per step, B = 128K / S, 8K..128K) and msa_long.json (B = 1,
256K..1M), per sequence (ms / B), beside a proxy of head dim 64 (msa_dp64.json, msa_dp64_long.json), with dense measured per sequence up to 128K and extrapolated beyond as S^2 from
its 128K time (marked as such). Memory: benchmarks/results/memory.json (B = 1).

    python benchmarks/plot_long.py [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
OPS = {"bf16 selection": "msa_func.fwd+bwd/deferred", "fp8 selection": "msa_func.fwd+bwd/deferred+fp8"}


def per_sequence_ms(rows, op, config="b") -> dict[int, float]:
    return {r["S"]: r["ms"] / r["B"] for r in rows if r["config"] == config and r["op"] == op and r.get("ms")}


def main(out: Path = RESULTS / "long.png") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short, long_ = (json.loads((RESULTS / f).read_text()) for f in ("msa_fp8.json", "msa_long.json"))
    memory = json.loads((RESULTS / "memory.json").read_text())
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6))
    for label, op in OPS.items():
        ms = {**per_sequence_ms(short["rows"], op), **per_sequence_ms(long_["rows"], op)}
        xs = sorted(ms)
        ax_t.plot(xs, [ms[s] for s in xs], "o-", label=f"MSA, {label}")
    dp64 = [json.loads((RESULTS / f).read_text()) for f in ("msa_dp64.json", "msa_dp64_long.json")]
    for label, op in OPS.items():  # a proxy of head dim 64 (config b64), 64K..1M
        ms = {k: v for d in dp64 for k, v in per_sequence_ms(d["rows"], op, "b64").items()}
        xs = sorted(ms)
        ax_t.plot(xs, [ms[s] for s in xs], "^--", label=f"MSA, Dp = 64, {label} ({dp64[1]['commit']})")
    dense = per_sequence_ms(short["rows"], "cudnn_dense.fwd+bwd")
    xs = sorted(dense)
    ax_t.plot(xs, [dense[s] for s in xs], "s-", color="gray", label="cuDNN dense (measured)")
    top = max(xs)
    far = [s for s in (top, 262144, 524288, 1048576)]
    ax_t.plot(far, [dense[top] * (s / top) ** 2 for s in far], "s--", color="gray", alpha=0.6,
              label="cuDNN dense (extrapolated as S^2)")
    ax_t.set(xscale="log", yscale="log", xlabel="S (tokens per sequence)", ylabel="ms per sequence, fwd + bwd",
             title=f"(b): whole op, deferred KL ({', '.join(sorted({short['commit'], long_['commit']}))})")
    ax_t.legend(fontsize=8)
    rows = memory["rows"]
    for op, kl, style, label in (("flash_msa_func", "exact", "o-", "MSA (exact KL)"),
                                 ("flash_msa_func", "deferred", "x:", "MSA (deferred KL)")):
        pts = sorted((r["S"], r["peak_bytes"] / 1e9) for r in rows if r["op"] == op and r.get("kl_value") == kl
                     and r.get("peak_bytes"))
        ax_m.plot(*zip(*pts), style, label=label)
    dense_pts = sorted((r["S"], r["peak_bytes"] / 1e9) for r in rows if r["op"] == "dense_sdpa" and r.get("peak_bytes"))
    ax_m.plot(*zip(*dense_pts), "s-", color="gray", label="dense SDPA (measured)")
    floor = sorted({(r["S"], r["floor_bytes"] / 1e9) for r in rows if r["op"] == "flash_msa_func"})
    ax_m.plot(*zip(*floor), "--", color="black", alpha=0.5, label="MSA inputs + out + dO + gradients")
    ax_m.axhline(64, color="red", lw=0.8, alpha=0.6, label="target at 1M: 64 GB")
    ax_m.set(xscale="log", yscale="log", xlabel="S (tokens, B = 1)", ylabel="peak GB allocated",
             title=f"(b): peak memory, fwd + bwd ({memory['commit']})")
    ax_m.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    print(main(Path(sys.argv[1])) if len(sys.argv) > 1 else main())
