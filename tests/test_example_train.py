"""The training example (examples/train_msa.py) end to end on the tiny preset: seconds on a CPU.

One uninterrupted run (MSA then dense), then a run resumed from the MSA checkpoint taken half way, which must
reproduce every later loss exactly: same batches (seeded per step), same weights, same optimizer state.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _train_main():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_msa

    return train_msa.main


def _run(out: Path, *extra: str) -> dict:
    args = ["--preset", "tiny", "--out", str(out), "--no-progress", *extra]
    if not HAVE_MPL:
        args.append("--no-plot")
    _train_main()(args)
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return out, _run(out)


def _finite_numbers(obj, where=""):
    """Every number in a nested JSON value, with its path; None allowed only where the caller says."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _finite_numbers(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _finite_numbers(v, f"{where}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield where, obj


def test_metrics_are_finite_for_both_runs(full):
    out, m = full
    assert set(m["runs"]) == {"msa", "dense"}
    steps = m["config"]["steps"]
    for name, run in m["runs"].items():
        h = run["history"]
        assert h["step"] == list(range(steps)), name
        for key in ("lm_loss", "loss", "tokens_per_s", "lr"):
            assert len(h[key]) == steps and all(math.isfinite(v) for v in h[key]), (name, key, h[key])
        assert run["val"]["val_loss"] and all(math.isfinite(v) for v in run["val"]["val_loss"]), name
        for path, v in _finite_numbers(run["summary"], name):
            assert math.isfinite(v), path
        assert run["summary"]["val_loss"] is not None and run["summary"]["tokens_per_s"] > 0
    assert m["runs"]["dense"]["history"]["kl"] == [None] * steps

    msa = m["runs"]["msa"]
    warmup = m["config"]["warmup_steps"]
    assert msa["history"]["mode"] == ["warmup"] * warmup + ["sparse"] * (steps - warmup)
    assert all(math.isfinite(v) and v >= 0 for v in msa["history"]["kl"])
    # Loss = LM + kl_coef * KL, both logged.
    for lm, kl, loss in zip(msa["history"]["lm_loss"], msa["history"]["kl"], msa["history"]["loss"]):
        assert loss == pytest.approx(lm + m["config"]["kl_coef"] * kl, rel=1e-5, abs=1e-6)
    # Recall is measured where the selection drops blocks: a share of the attention mass, and the selection keeps
    # fewer keys than the causal prefix holds (tiny preset: 2 of 4 blocks for queries in blocks 2 and 3).
    r = msa["recall"]
    assert r["step"] and r["step"][-1] == steps - 1
    assert all(0.0 <= v <= 1.0 + 1e-6 for v in r["recall"]), r["recall"]
    assert all(0.0 < c < 1.0 for c in r["coverage"]), r["coverage"]


def test_same_init_and_data_for_both_runs(full):
    """Step 0 of the MSA run is warmup (dense main attention): with the same weights and batch as the dense
    baseline its LM loss matches, up to the difference of the reference and SDPA in float32."""
    _, m = full
    a, b = m["runs"]["msa"]["history"]["lm_loss"][0], m["runs"]["dense"]["history"]["lm_loss"][0]
    assert a == pytest.approx(b, rel=1e-5), (a, b)
    # ... and the runs diverge afterwards (sparse attention differs from dense).
    assert m["runs"]["msa"]["history"]["lm_loss"][-1] != m["runs"]["dense"]["history"]["lm_loss"][-1]


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (pip install matplotlib)")
def test_summary_says_which_backend_ran_and_what_to_expect(full):
    """Issue 39: the metrics record the backends that actually ran each MSA op, and the summary says what to
    expect from them (on a CPU: the reference, slow by design)."""
    _, m = full
    assert set(m["msa_backends"]) >= {"select_blocks", "msa_forward", "msa_backward", "warmup_forward",
                                      "warmup_backward"}
    if m["config"]["device"] == "cpu":
        assert all(ns == ["reference"] for ns in m["msa_backends"].values()), m["msa_backends"]
        assert m["msa_backend"] == "reference"
        assert "slow by design" in m["msa_backend_note"] and "nothing about the kernels" in m["msa_backend_note"]
    train_msa = sys.modules[_train_main().__module__]
    summary = train_msa.format_summary(m)
    assert m["msa_backend_note"] in summary and f"MSA backend: {m['msa_backend']}" in summary
    assert train_msa.backend_label({"msa_forward": {"kernels"}, "msa_backward": {"reference"}}) == \
        "kernels + reference (msa_backward)"
    assert "AOT kernels" in train_msa.backend_note("kernels", "NVIDIA H200")


def test_plot_is_written(full):
    out, _ = full
    png = out / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_reproduces_the_uninterrupted_losses(full, tmp_path, capsys):
    out, m = full
    ckpt = out / "checkpoints" / "msa_step000003.pt"
    assert ckpt.exists(), sorted(p.name for p in (out / "checkpoints").iterdir())
    capsys.readouterr()
    r = _run(tmp_path / "resumed", "--resume", str(ckpt))
    # The closing line names every file the run left in its folder, its checkpoints too.
    last = capsys.readouterr().out.strip().splitlines()[-1]
    left = sorted(str(p.relative_to(tmp_path / "resumed")) for p in (tmp_path / "resumed").rglob("*") if p.is_file())
    assert any(name.startswith("checkpoints/") for name in left), left
    assert last.startswith(f"wrote {len(left)} files (") and all(name in last for name in left), (last, left)
    assert r["resumed_from"] == str(ckpt)
    for name in ("msa", "dense"):
        a, b = m["runs"][name], r["runs"][name]
        for key in ("lm_loss", "kl", "loss"):
            assert b["history"][key] == a["history"][key], (name, key)
        assert b["val"] == a["val"], name
        assert b["recall"]["recall"] == a["recall"]["recall"], name


def test_exact_and_deferred_kl_train_the_same_model(full, tmp_path):
    """kl_value "deferred" logs the KL the backward wrote; "exact" takes it from the forward (the default "auto"
    picks it on the CPU reference, where the KL pass alone is the whole forward again). The gradients are the same,
    so the two runs are the same run: every logged loss and KL equal."""
    _, exact = full
    assert exact["config"]["kl_value"] == "auto" and exact["kl_value"] == "exact"
    deferred = _run(tmp_path, "--runs", "msa", "--kl-value", "deferred")
    assert deferred["kl_value"] == "deferred"
    for key in ("lm_loss", "kl", "loss"):
        assert exact["runs"]["msa"]["history"][key] == deferred["runs"]["msa"]["history"][key], key


def test_context_parallel_run_matches_the_single_process_run(full, tmp_path):
    """`torchrun --nproc-per-node 2 examples/train_msa.py --cp 2` (gloo on CPU): every sequence sharded over two
    processes (zigzag), the MSA run's LM losses and proxy KL equal the single-process run's step for step."""
    import os
    import subprocess

    _, single = full
    repo = EXAMPLES.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "train_msa.py"), "--preset", "tiny", "--cp", "2", "--runs", "msa", "--out", str(tmp_path),
           "--no-progress"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cp = json.loads((tmp_path / "cp_metrics.json").read_text())
    assert cp["cp"] == 2 and cp["kl_value"] == "exact"  # "auto" on the CPU reference
    want = single["runs"]["msa"]["history"]
    assert cp["history"]["mode"] == want["mode"]
    for key in ("lm_loss", "kl"):
        assert cp["history"][key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_sinks_and_local_blocks_flags_reach_the_model_and_the_api():
    """--sinks gives every layer a learned (H,) sink that the MSA attention trains; --local-blocks reaches the call."""
    import torch

    _train_main()  # puts examples/ on sys.path
    import msa_model
    import train_msa

    cfg = train_msa.build_config(train_msa.parse_args(["--sinks", "--local-blocks", "2"]))
    assert cfg.sinks and cfg.local_blocks == 2
    torch.manual_seed(0)
    model = msa_model.ByteLM(cfg.model_config())
    attend = msa_model.msa_attend("sparse", cfg.top_k, cfg.block_size, local_blocks=cfg.local_blocks)
    logits, kl = model(torch.randint(0, 256, (1, 3 * cfg.block_size)), attend)
    logits.float().square().mean().backward()
    sinks = [p for n, p in model.named_parameters() if n.endswith("sinks")]
    assert len(sinks) == cfg.n_layers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in sinks)
    with pytest.raises(ValueError, match="local_blocks"):
        train_msa.build_config(train_msa.parse_args(["--local-blocks", str(cfg.top_k // cfg.block_size + 1)]))


def test_compile_default_is_cuda_only():
    """--compile auto: on for CUDA, off on the CPU (TrainConfig.compile says why); a bad value names the flag."""
    _train_main()
    import train_msa

    assert train_msa.resolved_compile(train_msa.TrainConfig(device="cuda"))
    assert not train_msa.resolved_compile(train_msa.TrainConfig(device="cpu"))
    assert train_msa.resolved_compile(train_msa.TrainConfig(device="cpu", compile="on"))
    with pytest.raises(ValueError, match="compile"):
        train_msa.TrainConfig(compile="yes").validate()
