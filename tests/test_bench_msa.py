"""benchmarks/bench_msa.py and plot_msa.py on the CPU: nnz and FLOP counts against hand counts and a brute-force
count, the skewed selection, the command line, the published-figure comparisons, and the plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_msa as bm

REPO = Path(__file__).resolve().parent.parent


def brute_nnz(block_indices: torch.Tensor, block_size: int) -> int:
    """Per (b, p, i): the set of causal keys t <= i whose block is listed (python sets)."""
    B, Hp, S, K = block_indices.shape
    total = 0
    for b in range(B):
        for p in range(Hp):
            for i in range(S):
                blocks = {int(j) for j in block_indices[b, p, i] if j >= 0}
                total += sum(1 for t in range(i + 1) if t // block_size in blocks)
    return total


def empty_rows(S, K, B=1, Hp=1):
    return torch.full((B, Hp, S, K), -1, dtype=torch.int32)


def test_nnz_hand_counted_rows_partial_last_block():
    S, Bs = 300, 128  # blocks [0, 128), [128, 256), [256, 300): the last holds 44 tokens
    idx = empty_rows(S, 3)
    idx[0, 0, 0] = torch.tensor([0, -1, -1])      # 1 key
    idx[0, 0, 5] = torch.tensor([0, -1, -1])      # 6
    idx[0, 0, 130] = torch.tensor([0, 1, -1])     # 128 + 3
    idx[0, 0, 200] = torch.tensor([1, 2, -1])     # 73 (block 2 lies after the query)
    idx[0, 0, 299] = torch.tensor([-1, 2, 0])     # 44 + 128, slot order free
    assert bm.nnz_per_index_head(idx, Bs) == 1 + 6 + 131 + 73 + 172


def test_nnz_duplicates_count_once_and_empty_rows_count_zero():
    idx = empty_rows(300, 3)
    idx[0, 0, 299] = torch.tensor([2, 0, 2])
    assert bm.nnz_per_index_head(idx, 128) == 172
    assert bm.nnz_per_index_head(empty_rows(300, 3), 128) == 0


def test_nnz_every_block_listed_is_dense_causal():
    S, Bs, H, Hp, B = 299, 64, 6, 2, 2
    nb = -(-S // Bs)
    idx = torch.arange(nb, dtype=torch.int32).expand(B, Hp, S, nb).contiguous()
    assert bm.nnz_per_index_head(idx, Bs) == B * Hp * S * (S + 1) // 2
    assert bm.nnz_main(idx, H, Bs) == bm.dense_nnz(B, H, S)


def test_nnz_random_selection_matches_brute_force_in_chunks():
    g = torch.Generator().manual_seed(3)
    S, Bs, K = 211, 32, 4
    idx = torch.randint(-1, -(-S // Bs), (2, 3, S, K), generator=g, dtype=torch.int32)
    # rows=50: chunk boundaries inside blocks must not change the count
    assert bm.nnz_per_index_head(idx, Bs, rows=50) == brute_nnz(idx, Bs)


def test_skewed_selection_is_block0_plus_nearest():
    S, Bs, K = 20 * 16 + 5, 16, 4
    idx = bm.skewed_block_indices(2, 3, S, K, Bs)
    assert idx.shape == (2, 3, S, K) and idx.dtype == torch.int32
    assert idx[0, 0, 0].tolist() == [0, -1, -1, -1]
    assert idx[1, 2, 2 * 16 + 7].tolist() == [0, 1, 2, -1]
    assert idx[0, 1, 3 * 16].tolist() == [0, 1, 2, 3]
    assert idx[0, 0, 10 * 16 + 1].tolist() == [0, 8, 9, 10]
    assert idx[0, 0, S - 1].tolist() == [0, 18, 19, 20]
    assert bm.nnz_per_index_head(idx, Bs) == brute_nnz(idx, Bs)


def test_flop_formulas():
    B, H, S, D = 1, 16, 8192, 128
    dense_fwd = 4 * D * H * B * S * (S + 1) / 2
    assert bm.dense_forward_flops(B, H, S) == dense_fwd
    assert bm.dense_fwd_bwd_flops(B, H, S) == 3.5 * dense_fwd
    assert bm.selection_flops(2, 65536, 8) == 2 * 128 * 8 * 2 * 65536 * 65537 / 2  # ~8.8e12 (kernel-notes.md)
    assert bm.main_forward_flops(1000) == 4 * 128 * 1000
    assert bm.main_backward_flops(1000) == 10 * 128 * 1000
    assert bm.whole_fwd_bwd_flops(1000) == 3.5 * 4 * 128 * 1000
    assert bm.tflops(2e12, 4.0) == pytest.approx(500.0)
    assert bm.tflops(None, 4.0) is None


def test_reference_guard_scales_and_remembers_timeouts():
    g = bm.ReferenceGuard()
    assert g.estimate("a:msa_forward", 16, 8192) is None
    g.record("a:msa_forward", 16, 8192, 2.0)
    assert g.estimate("a:msa_forward", 8, 16384) == pytest.approx(4.0)  # B*S fixed: linear in S
    assert g.estimate("a:msa_forward", 1, 16384) == pytest.approx(2.0 * 16384 ** 2 / (16 * 8192 ** 2))  # B*S^2
    g.record("a:msa_forward", 1, 16384, 1.0)
    assert g.estimate("a:msa_forward", 1, 32768) == pytest.approx(8.0)  # the (B*S)^2*S term: the K/V re-reads
    assert g.estimate("a:msa_forward", 16, 4096) is None
    g.record("a:warmup_forward", 1, 8192, math.inf)
    assert math.isinf(g.estimate("a:warmup_forward", 1, 16384))


def test_reference_guard_composite_sums_its_parts():
    g = bm.ReferenceGuard()
    assert g.estimate_call("a:msa_func.fwd+bwd", ["a:msa_forward", "a:msa_backward"], 16, 8192) is None
    g.record("a:msa_forward", 16, 8192, 3.0)
    g.record("a:msa_backward", 16, 8192, 4.0)
    assert g.estimate_call("a:msa_func.fwd+bwd", ["a:msa_forward", "a:msa_backward"], 16, 8192) == 7.0
    g.record("a:msa_func.fwd+bwd", 16, 8192, 9.0)  # its own history wins when larger
    assert g.estimate_call("a:msa_func.fwd+bwd", ["a:msa_forward", "a:msa_backward"], 16, 8192) == 9.0
    g.record("b:msa_forward", 16, 8192, math.inf)  # per configuration
    assert g.estimate_call("a:msa_func.fwd", ["a:msa_forward"], 16, 8192) == 3.0


def test_cli_defaults_and_flags(tmp_path):
    a = bm.parse_args([])
    assert a.configs == ["a", "b", "c"] and a.seqlens == list(bm.SEQLENS) and a.ops == ["sparse", "warmup", "dense"]
    assert not a.batch1 and not a.skewed and a.out.name == "msa.json"
    assert [bm.batch_of(a, s) for s in a.seqlens] == [16, 8, 4, 2, 1]
    a = bm.parse_args(["--configs", "a,b", "--seqlens", "8192,16384", "--batch1", "--ops", "sparse,warmup",
                       "--out", str(tmp_path / "x.json"), "--max-seconds", "3", "--skewed"])
    assert a.configs == ["a", "b"] and a.seqlens == [8192, 16384] and a.ops == ["sparse", "warmup"]
    assert a.batch1 and a.skewed and a.max_seconds == 3.0 and a.out == tmp_path / "x.json"
    assert bm.batch_of(a, 8192) == 1
    assert bm.parse_args(["--batch1"]).out.name == "msa_batch1.json"


def test_small_proxy_configuration():
    """b64 is (b) with Dp = 64, run only when named; its selection FLOPs are half of (b)'s."""
    a = bm.parse_args(["--configs", "b,b64"])
    assert a.configs == ["b", "b64"] and "b64" not in bm.parse_args([]).configs
    assert bm.shape_of("b64") == (*bm.CONFIGS["b"], 64) and bm.shape_of("b") == (*bm.CONFIGS["b"], 128)
    assert bm.selection_flops(2, 65536, 8, bm.shape_of("b64")[4]) * 2 == bm.selection_flops(2, 65536, 8)


@pytest.mark.parametrize("argv", [["--configs", "a,d"], ["--seqlens", "0"], ["--seqlens", "8k"], ["--ops", "fast"],
                                  ["--reps", "0"], ["--max-seconds", "0"]])
def test_cli_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bm.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_main_without_cuda_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bm.main(["--configs", "a", "--seqlens", "8192"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_help_runs_as_a_script_without_pythonpath(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_msa.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--batch1" in r.stdout and "--max-seconds" in r.stdout


def _row(cfg, B, S, op, ms, status="ok", selection=None, peak=None):
    return dict(config=cfg, B=B, S=S, op=op, ms=ms if status == "ok" else None, status=status,
                selection=selection, peak_mem_bytes=peak, tflops=None, backend="x")


def synthetic_rows():
    rows = []
    for S, msa, dense in ((8192, 20.0, 2.0), (16384, 30.0, 6.0), (32768, 40.0, 40.0)):
        rows += [_row("a", 1, S, "msa_func.fwd+bwd", msa, selection="proxy top-K", peak=3 << 30),
                 _row("a", 1, S, "msa_func.fwd", msa / 4, selection="proxy top-K"),
                 _row("a", 1, S, "cudnn_dense.fwd+bwd", dense, selection="dense causal", peak=1 << 30),
                 _row("a", 1, S, "cudnn_dense.fwd", dense / 3.5, selection="dense causal"),
                 _row("a", 1, S, "warmup_func.fwd+bwd", None, status="skipped: reference backend (...)",
                      selection="dense causal")]
        rows += [_row("b", 1, S, "msa_func.fwd+bwd", msa * 2, selection="proxy top-K"),
                 _row("b", 1, S, "cudnn_dense.fwd+bwd", dense * 2, selection="dense causal"),
                 _row("b", 1, S, "cudnn_dense.fwd", dense / 2, selection="dense causal"),
                 _row("b", 1, S, "warmup_func.fwd+bwd", dense * 3, selection="dense causal"),
                 _row("b", 1, S, "warmup_func.fwd", dense, selection="dense causal")]
    return rows


def test_comparisons_against_dense_and_published():
    comps = {(c["config"], c["S"]): c for c in bm.comparisons(synthetic_rows())}
    a8 = comps[("a", 8192)]
    assert a8["x_dense"] == pytest.approx(2.0 / 20.0)
    assert a8["warmup_x_dense"] is None  # skipped rows never enter a ratio
    p = a8["published"]
    assert p["flash_msa_fwd_bwd_ms"] == 19.1 and p["x_flash_msa"] == pytest.approx(19.1 / 20.0)
    assert p["x_fsa"] == pytest.approx(16.7 / 20.0)
    assert p["this_run_dense_vs_published"] == pytest.approx(1.97 / 2.0)
    assert "not re-measured" in p["source"]
    assert "published" not in comps[("b", 8192)]  # the published shape is config (a) only
    assert comps[("a", 32768)]["x_dense"] == pytest.approx(1.0)
    # warmup against cuDNN as issue 5 measures it: warmup time over dense time, forward and forward+backward
    b8 = comps[("b", 8192)]
    assert b8["warmup_fwd_over_dense"] == pytest.approx(2.0)  # 2.0 ms warmup forward, 1.0 ms cuDNN's
    assert b8["warmup_fwd_bwd_over_dense"] == pytest.approx(1.5)  # 6.0 ms against 4.0
    assert a8["warmup_fwd_over_dense"] is None and a8["warmup_fwd_bwd_over_dense"] is None


def test_table_prints_the_warmup_ratios(capsys):
    rows = synthetic_rows()
    bm.print_table(rows, bm.comparisons(rows))
    out = capsys.readouterr().out
    assert "warmup mode's time over cuDNN" in out
    assert "  b   1   8192    2.00x    1.50x" in out


def test_plot_renders_png(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot_msa

    rows = synthetic_rows()
    data = dict(device="synthetic", torch="0", commit="0123456789abcdef", rows=rows,
                comparisons=bm.comparisons(rows), published=json.loads(json.dumps(bm.PUBLISHED)),
                shape=dict(configs={c: dict(zip(("H", "Hk", "Hp", "Hpk"), bm.CONFIGS[c])) for c in "ab"}))
    path = tmp_path / "msa.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "msa.png"
    plot_msa.main([str(path), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize("cfg", ["a", "b", "c"])
def test_stage_benchmarks_inputs(cfg):
    """bench_sparse_fwd.random_problem, which the stage, sweep and profile benchmarks share: issue 4's head
    counts, B = tokens // S (at least 1), bf16, and the same tensors for the same seed."""
    from benchmarks.bench_sparse_fwd import CONFIGS, random_problem

    x = random_problem(cfg, 256, tokens=1024, device="cpu")
    H, Hk, Hp, Hpk = CONFIGS[cfg]
    assert (x["B"], x["G"], x["D"]) == (4, H // Hp, 128) and x["scale"] == 128 ** -0.5
    for name, heads in (("qp", Hp), ("kp", Hpk), ("q", H), ("k", Hk), ("v", Hk)):
        assert x[name].shape == (4, 256, heads, 128) and x[name].dtype == torch.bfloat16
    assert random_problem(cfg, 512, tokens=256, device="cpu")["B"] == 1
    assert torch.equal(random_problem(cfg, 256, tokens=1024, device="cpu")["v"], x["v"])


def test_clock_samples_summary_parses_nvidia_smi_lines():
    """The clocks beside each timing: medians of nvidia-smi's csv lines, the share under the software power cap
    (reason bit 0x4), unreadable lines skipped, nothing at all without samples."""
    from benchmarks.common import ClockSamples

    c = ClockSamples()
    assert c.summary() == {}
    c.lines = ["1980, 650.5, 0x0000000000000000", "1755, 700.1, 0x0000000000000004", "[N/A], 1.0, 0x0",
               "1400, 699.0, 0x0000000000000004"]
    got = c.summary()
    assert got == dict(sm_clock_mhz=1755.0, sm_clock_min_mhz=1400.0, power_w=699.0, power_capped=2 / 3,
                       clock_samples=3)


# --- issue 53's matrix: --head-dim / --proxy-head-dim / --block-size / --tag ------------------------------------

def test_matrix_options_defaults_and_derived_names(tmp_path):
    a = bm.parse_args([])
    assert (a.head_dim, a.proxy_head_dim, a.block_size, a.tag) == (128, 128, 128, None)
    assert a.out.name == "msa.json" and bm.shape_record(a) == dict(
        D=128, Dp=128, block_size=128, top_k=2048, K=16, dtype="bfloat16", tag=None,
        configs={c: dict(zip(("H", "Hk", "Hp", "Hpk", "Dp"), (*bm.CONFIGS[c], 128))) for c in "abc"})
    a = bm.parse_args(["--configs", "b,b64", "--head-dim", "64", "--block-size", "64"])
    assert (a.head_dim, a.proxy_head_dim, a.block_size) == (64, 64, 64)  # Dp 64 at D 64
    assert a.out.name == "msa_matrix_d64_b64.json" and a.tag == "matrix_d64_b64"
    shape = bm.shape_record(a)
    assert (shape["D"], shape["Dp"], shape["block_size"], shape["K"]) == (64, 64, 64, 32)
    assert shape["configs"]["b"]["Dp"] == 64 and shape["configs"]["b64"]["Dp"] == 64
    a = bm.parse_args(["--head-dim", "256"])
    assert a.proxy_head_dim == 128 and a.out.name == "msa_matrix_d256_b128.json"
    assert bm.parse_args(["--head-dim", "32"]).proxy_head_dim == 32  # capped at D
    a = bm.parse_args(["--head-dim", "64", "--proxy-head-dim", "128"])
    assert a.proxy_head_dim == 128 and a.out.name == "msa_matrix_d64_b128_dp128.json"
    a = bm.parse_args(["--tag", "mine", "--batch1"])
    assert a.out.name == "msa_mine_batch1.json" and bm.shape_record(a)["tag"] == "mine"
    a = bm.parse_args(["--head-dim", "64", "--out", str(tmp_path / "x.json")])
    assert a.out == tmp_path / "x.json" and a.tag == "matrix_d64_b128"
    for argv in (["--block-size", "96"], ["--block-size", "0"], ["--head-dim", "0"], ["--tag", "a/b"]):
        with pytest.raises(SystemExit):
            bm.parse_args(argv)


def test_matrix_flops_follow_head_dim():
    assert bm.main_forward_flops(1000, 64) == 4 * 64 * 1000
    assert bm.main_backward_flops(1000, 256) == 10 * 256 * 1000
    assert bm.dense_fwd_bwd_flops(1, 32, 65536, 64) == 3.5 * 4 * 64 * 32 * 65536 * 65537 / 2


class HostTimer:
    """bench_msa.Timer's interface on the host clock: one call, no CUDA events (the CPU runs below)."""

    def __init__(self, args=None):
        self.alarm = bm.Alarm()

    def run(self, fn, limit_s, reference=False):
        import time

        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return dict(ms=ms, times_ms=[ms], reps=1, first_call_s=ms / 1e3, peak_mem_bytes=0)


def test_matrix_options_reach_the_ops_and_the_json_on_the_reference(tmp_path, monkeypatch):
    """main() end to end on the CPU (reference backend, host timer, tiny shape): D 64, Dp 64, Bs 64 reach the
    inputs, the selection (K = 32 blocks: every block of S = 128, so nnz is dense causal), the ops and the JSON's
    shape, rows and per-mode comparison (deferred KL)."""
    import functools

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu (test)")
    monkeypatch.setattr(bm, "Timer", HostTimer)
    monkeypatch.setattr(bm, "Case", functools.partial(bm.Case, device="cpu"))
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "m.json"
    assert bm.main(["--configs", "a", "--seqlens", "128", "--tokens", "128", "--ops", "sparse", "--kl-values",
                    "deferred", "--head-dim", "64", "--block-size", "64", "--tag", "t", "--out", str(out),
                    "--max-seconds", "60"]) == 0
    data = json.loads(out.read_text())
    shape = data["shape"]
    assert (shape["D"], shape["Dp"], shape["block_size"], shape["K"], shape["tag"]) == (64, 64, 64, 32, "t")
    rows = {r["op"]: r for r in data["rows"]}
    assert set(rows) == {"select_blocks", "msa_forward", "msa_backward", "msa_func.fwd/deferred",
                         "msa_func.fwd+bwd/deferred"}
    H = bm.CONFIGS["a"][0]
    for r in rows.values():
        assert r["status"] == "ok", r
        assert (r["D"], r["Dp"], r["block_size"], r["K"]) == (64, 64, 64, 32)
    nnz = bm.dense_nnz(1, H, 128)
    assert rows["msa_forward"]["nnz"] == nnz and rows["msa_forward"]["flops"] == 4 * 64 * nnz
    assert rows["msa_func.fwd+bwd/deferred"]["flops"] == 3.5 * 4 * 64 * nnz
    (comp,) = data["comparisons"]
    m = comp["modes"]["deferred"]
    assert m["msa_fwd_tflops"] == pytest.approx(4 * 64 * nnz / rows["msa_func.fwd/deferred"]["ms"] / 1e9)
    assert m["msa_bwd_tflops"] == pytest.approx(10 * 64 * nnz / (rows["msa_func.fwd+bwd/deferred"]["ms"] -
                                                                 rows["msa_func.fwd/deferred"]["ms"]) / 1e9)
    assert m["x_dense"] is None and comp["primary_mode"] is None  # no dense on the CPU
    assert "msa_func.bwd" in data["formulas"] and "cudnn_dense.bwd" in data["formulas"]


def test_comparisons_per_mode_speedup_and_tflops():
    rows = []
    for op, ms, flops in (("msa_func.fwd/deferred", 10.0, 4e12), ("msa_func.fwd+bwd/deferred", 30.0, 14e12),
                          ("msa_func.fwd", 12.0, 4e12), ("msa_func.fwd+bwd", 40.0, 14e12)):
        rows.append(dict(_row("b", 2, 65536, op, ms, selection="proxy top-K"), flops=flops, tflops=flops / ms / 1e9))
    for op, ms, flops in (("cudnn_dense.fwd", 100.0, 40e12), ("cudnn_dense.fwd+bwd", 300.0, 140e12)):
        rows.append(dict(_row("b", 2, 65536, op, ms, selection="dense causal"), flops=flops, tflops=flops / ms / 1e9))
    (c,) = bm.comparisons(rows)
    assert list(c["modes"]) == ["exact", "deferred"] and c["primary_mode"] == "deferred"
    d = c["modes"]["deferred"]
    assert d["x_dense"] == pytest.approx(10.0) and c["modes"]["exact"]["x_dense"] == pytest.approx(7.5)
    assert c["x_dense"] == pytest.approx(7.5)  # the exact op's, as before
    assert d["msa_fwd_tflops"] == pytest.approx(400.0) and d["msa_bwd_tflops"] == pytest.approx(10e12 / 20 / 1e9)
    assert c["dense_fwd_tflops"] == pytest.approx(400.0) and c["dense_bwd_tflops"] == pytest.approx(500.0)


def test_plot_matrix_renders_several_configurations(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from benchmarks import plot_matrix

    paths = []
    for D, Bs, x in ((128, 128, 6.0), (64, 128, 5.4), (64, 64, 4.0)):
        rows = []
        for S, msa in ((65536, 80.0), (131072, 95.0)):
            rows += [dict(_row("b", 131072 // S, S, "msa_func.fwd+bwd/deferred", msa, selection="proxy top-K"),
                          flops=1e12, tflops=100.0),
                     dict(_row("b", 131072 // S, S, "msa_func.fwd/deferred", msa / 3, selection="proxy top-K"),
                          flops=1e12 / 3.5, tflops=100.0),
                     _row("b", 131072 // S, S, "cudnn_dense.fwd+bwd", msa * x * S / 65536, selection="dense causal")]
        data = dict(device="synthetic", commit="0123456789", rows=rows, comparisons=bm.comparisons(rows),
                    shape=dict(D=D, Dp=min(D, 128), block_size=Bs, K=2048 // Bs, tag=f"matrix_d{D}_b{Bs}"))
        p = tmp_path / f"msa_matrix_d{D}_b{Bs}.json"
        p.write_text(json.dumps(data))
        paths.append(p)
    out = tmp_path / "matrix.png"
    plot_matrix.main([*map(str, paths), "--out", str(out), "--baseline", str(paths[0])])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "D=64 Dp=64 Bs=128" in text and "90%" in text  # 5.4x of 6.0x
