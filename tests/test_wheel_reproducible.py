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
