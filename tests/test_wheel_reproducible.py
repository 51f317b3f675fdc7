"""Two release builds of one source tree, each compiling from scratch (separate caches and work folders), give
byte-identical distributions: the sdist, the runtime wheel and a per-arch wheel (one tiny variant)."""

from __future__ import annotations

from test_packaging import release, snapshot


def test_two_builds_are_byte_identical(tmp_path):
    src = snapshot(tmp_path / "src")
    first = release(src, tmp_path / "a" / "dist", "sm90a", tmp_path / "a" / "cache")
    second = release(src, tmp_path / "b" / "dist", "sm90a", tmp_path / "b" / "cache")
    assert len(first) == 3 and any(n.startswith("flash_msa_rt_sm90a-") for n in first)
    assert list((tmp_path / "b" / "cache" / "sm90a").glob("*.cubin")), "the second build compiled nothing"
    assert first == second


def test_a_d256_variant_compiles_to_the_same_bytes_twice(tmp_path):
    """The matrix's new point: a D 256 backward variant (64-key blocks, one gather stage, deterministic) compiled
    from scratch twice, each in its own artifact folder, gives the same cubin bytes."""
    import subprocess
    import sys

    name = "sparse_bwd_bf16_d256_b64_g4_m64_n64_t256_s1_mmawgmma_tauout1_det1_sm90a"
    cubins = []
    for run in ("a", "b"):
        out = tmp_path / run
        subprocess.run([sys.executable, "-m", "build_tools", "build", "--arch", "sm90a", "--head-dim", "256",
                        "--block-size", "64", "--only", name, "--out", str(out), "--no-progress", "--force"],
                       check=True, capture_output=True, text=True)
        cubins.append((out / "sm90a" / f"{name}.cubin").read_bytes())
    assert cubins[0] and cubins[0] == cubins[1]
