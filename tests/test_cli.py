import json
import subprocess
import sys
from pathlib import Path

from test_runtime_cpu import toy_entry, write_artifacts

REPO = Path(__file__).resolve().parent.parent


def run(*args, env_extra=None, cwd=REPO):
    import os
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=300)


def _no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def test_info_summarises_each_arch_per_kernel_family(tmp_path):
    write_artifacts(tmp_path, [toy_entry("sm90a"), toy_entry("sm100a")])
    r = run("flash_msa_rt", "info", env_extra={"FLASH_MSA_ARTIFACT_DIR": str(tmp_path)})
    out = r.stdout
    assert "flash-msa runtime 0.1.0" in out
    assert "sm90a: 1 variant in 1 kernel family, built with nvidia-cutlass-dsl 4.8.1" in out
    assert "sm100a: 1 variant in 1 kernel family" in out
    assert "toy                         1 variant" in out
    assert "toy_bf16_d128_b128_sm100a" not in out and "--verbose lists every variant" in out
    assert "device:" in out
    if _no_gpu():
        assert r.returncode == 3 and "exit 3" in out, (r.returncode, out)
    verbose = run("flash_msa_rt", "info", "--verbose", env_extra={"FLASH_MSA_ARTIFACT_DIR": str(tmp_path)})
    assert "toy_bf16_d128_b128_sm100a" in verbose.stdout and "regs  80" in verbose.stdout


def test_info_into_a_closed_pipe_ends_quietly(tmp_path):
    """`info --verbose | head`: the reader goes away; no BrokenPipeError traceback."""
    import os

    write_artifacts(tmp_path, [toy_entry("sm90a"), toy_entry("sm100a")])
    env = dict(os.environ, FLASH_MSA_ARTIFACT_DIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "flash_msa_rt", "info", "--verbose"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # nothing read: the first write to stdout fails
    err = p.stderr.read().decode()
    p.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert p.returncode == 1


def test_info_without_artifacts_never_exits_zero(tmp_path):
    r = run("flash_msa_rt", "info", env_extra={"FLASH_MSA_ARTIFACT_DIR": "/nonexistent"})
    assert r.returncode in (3, 4), r.stdout
    assert "no artifacts found" in r.stdout and "python -m build_tools build" in r.stdout
    assert "flash-msa-rt-sm90a" in r.stdout


def test_info_says_it_reports_the_source_checkout():
    r = run("flash_msa_rt", "info", cwd=REPO)
    assert f"imported from the source checkout {REPO}" in r.stdout and "not the installed package" in r.stdout


def test_usage_errors_exit_2():
    for args in (("flash_msa_rt",), ("flash_msa_rt", "bogus"), ("flash_msa_rt", "selftest", "--bogus"),
                 ("flash_msa_rt", "info", "extra")):
        r = run(*args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "usage:" in r.stderr


def test_selftest_without_gpu_exits_3():
    if not _no_gpu():
        import pytest

        pytest.skip("a GPU is visible")
    r = run("flash_msa_rt", "selftest", "--quick")
    assert r.returncode == 3 and "no GPU" in r.stderr and "torch.cuda.is_available() is False" in r.stderr


def _fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H200"):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)


def test_info_exit_codes_with_a_gpu(tmp_path, monkeypatch, capsys, artifact_dir_env):
    """Mocked devices: the arch carried -> 0 and the selftest hint; not carried -> 4 naming the package to
    install; a GPU no build serves -> 4."""
    from flash_msa_rt.__main__ import Exit, info

    write_artifacts(tmp_path, [toy_entry("sm90a")])
    artifact_dir_env(tmp_path)
    _fake_gpu(monkeypatch)
    assert info() == Exit.OK == 0
    assert "sm90a carried" in capsys.readouterr().out
    _fake_gpu(monkeypatch, (10, 0), "NVIDIA B200")
    assert info() == Exit.NO_ARTIFACTS == 4
    out = capsys.readouterr().out
    assert "needs sm100a or sm100f: NOT carried" in out and "pip install" in out and "flash-msa-rt-sm100a" in out
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100")
    assert info() == 4 and "compute capability 8.0" in capsys.readouterr().out


def test_selftest_exit_codes_and_json(tmp_path, monkeypatch, capsys, artifact_dir_env):
    """4 when the GPU's arch has no artifacts (naming the package), 5 when a check fails, 0 when all pass; --json
    writes the report."""
    import json

    from flash_msa_rt import __main__ as cli
    from flash_msa_rt import selftest as st

    artifact_dir_env(tmp_path / "empty")
    monkeypatch.setattr(st, "device_arch", lambda: ("NVIDIA H200", "sm90a"))
    assert cli.main(["selftest", "--quick"]) == cli.Exit.NO_ARTIFACTS
    err = capsys.readouterr().err
    assert "no sm90a artifacts" in err and "pip install" in err and "flash-msa-rt-sm90a" in err

    write_artifacts(tmp_path, [toy_entry("sm90a")])
    artifact_dir_env(tmp_path)
    rows = [st.Row("sparse_fwd", "bf16", "out", "kernels", 1e-3, 4e-3, 0.01, "ok")]
    monkeypatch.setattr(st, "run", lambda quick, echo=None: st.Report("NVIDIA H200", "sm90a", quick, list(rows)))
    path = tmp_path / "r.json"
    assert cli.main(["selftest", "--quick", "--json", str(path)]) == cli.Exit.OK
    assert json.loads(path.read_text())["passed"] is True
    rows.append(st.Row("sparse_bwd", "bf16", "dq", "reference", 0.0, 4e-3, 0.01, "FAIL", "ran on the reference"))
    assert cli.main(["selftest", "--json", str(path)]) == cli.Exit.SELFTEST_FAILED == 5
    j = json.loads(path.read_text())
    assert j["passed"] is False and j["quick"] is False and [r["status"] for r in j["rows"]] == ["ok", "FAIL"]
    assert "FAILED: 1 of 2 checks" in capsys.readouterr().out


def test_build_tools_list_and_bad_arch():
    r = run("build_tools", "list", "--arch", "sm90a,sm100a", "--out", "/nonexistent")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("block_scores_")]
    assert lines and all(l.split()[-2:] == ["not", "built"] for l in lines)
    assert any("_sm90a" in l for l in lines) and any("_sm100a" in l for l in lines)
    r = run("build_tools", "build", "--arch", "sm80")
    assert r.returncode == 2 and "--arch 'sm80' is not supported" in r.stderr


def test_build_refuses_a_config_nothing_implements():
    r = run("build_tools", "build", "--arch", "sm90a", "--head-dim", "96", "--out", "/nonexistent")
    assert r.returncode == 2 and "head_dim 96 not supported" in r.stderr and "pure-PyTorch reference" in r.stderr


def test_build_help_names_the_matrix():
    """`build --help` names the head dims and key blocks the kernels are written for, and the default build's."""
    from kernels_src import matrix

    r = run("build_tools", "build", "--help")
    text = " ".join(r.stdout.split())  # argparse wraps the help text
    assert r.returncode == 0, r.stderr
    join = lambda values: ",".join(map(str, values))  # noqa: E731
    for phrase in (f"any of {join(matrix.HEAD_DIMS)} (default: {join(matrix.DEFAULT_HEAD_DIMS)})",
                   f"any of {join(matrix.BLOCK_SIZES)} (default: {join(matrix.DEFAULT_BLOCK_SIZES)})",
                   "bf16, f16"):
        assert phrase in text, (phrase, r.stdout)


def test_build_tools_names_the_pinned_cutlass_dsl_when_it_is_missing(monkeypatch):
    """Issue 39: without CuTeDSL the build named no version ("the version pinned in pyproject.toml")."""
    import importlib.metadata as md
    import re

    import pytest

    from build_tools import build

    real = md.version

    def version(name):
        if name == build.CUTLASS_DIST:
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    with pytest.raises(build.BuildError) as info:
        build.toolchain_version()
    assert re.search(r"pip install 'nvidia-cutlass-dsl(\[\w+\])?==\d+\.\d+", str(info.value)), str(info.value)
