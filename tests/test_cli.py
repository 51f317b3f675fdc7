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


def test_info_lists_archs_variants_and_device(tmp_path):
    write_artifacts(tmp_path, [toy_entry("sm90a"), toy_entry("sm100a")])
    r = run("flash_msa_rt", "info", env_extra={"FLASH_MSA_ARTIFACT_DIR": str(tmp_path)})
    assert r.returncode in (0, 1), r.stderr
    out = r.stdout
    assert "flash-msa runtime 0.1.0" in out
    assert "sm90a: 1 variants, built with nvidia-cutlass-dsl 4.8.1" in out
    assert "sm100a: 1 variants" in out and "toy_bf16_d128_b128_sm100a" in out
    assert "device:" in out


def test_info_explains_missing_artifacts(tmp_path):
    r = run("flash_msa_rt", "info", env_extra={"FLASH_MSA_ARTIFACT_DIR": str(tmp_path / "none")})
    assert "no artifacts found" in r.stdout and "python -m build_tools build" in r.stdout


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
    assert r.returncode == 2 and "no variant can implement" in r.stderr
