"""examples/finetune_minimax_m3.py end to end on its tiny preset (seconds on a CPU): warmup steps then sparse
steps of a MiniMax-M3-shaped transformers model through the integration, every logged number finite, the plot
written."""

from __future__ import annotations

import importlib.util
import math
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.minimax_m3_vl", reason="the [transformers] extra is not installed")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def test_finetune_minimax_m3_tiny_preset(tmp_path):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import finetune_minimax_m3

    args = ["--preset", "tiny", "--out", str(tmp_path), "--no-progress"] + ([] if HAVE_MPL else ["--no-plot"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pure-PyTorch reference.*")
        metrics = finetune_minimax_m3.main(args)
    history = metrics["history"]
    assert [r["mode"] for r in history] == ["warmup", "warmup", "sparse", "sparse"]
    for row in history:
        assert math.isfinite(row["lm_loss"]) and math.isfinite(row["kl"]) and row["kl"] > 0, row
    recalls = [r["recall"] for r in history if "recall" in r]
    assert recalls and all(0 < r <= 1 for r in recalls)
    assert (tmp_path / "metrics.json").exists()
    assert not HAVE_MPL or (tmp_path / "metrics.png").stat().st_size > 0
