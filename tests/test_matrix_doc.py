"""The supported matrix that README.md and docs/matrix.md show is the catalogue's (build_tools.coverage)."""

from pathlib import Path

import pytest

from build_tools import coverage

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("rel", coverage.MATRIX_FILES)
def test_committed_matrix_matches_the_catalogue(rel):
    text = (REPO / rel).read_text()
    assert coverage.MATRIX_BEGIN in text and coverage.MATRIX_END in text, f"{rel}: no supported-matrix markers"
    assert coverage.splice_matrix(text) == text, (
        f"{rel}: the supported matrix disagrees with the kernel catalogue; run python -m build_tools matrix --write")


def test_matrix_marks_what_each_arch_runs():
    """Every point runs every op on both archs' kernels (sm100a's mma.sync at D 256 with dQ and O in column
    pieces); a point outside the wheel names the build command."""
    table = coverage.matrix_table()
    rows = {tuple(r.split(" | ")[:2]): r for r in table.splitlines()[2:]}
    assert "yes" in rows[("| 128", "128")]
    for point in (("| 128", "128"), ("| 256", "128"), ("| 64", "64")):
        assert rows[point].count("kernels / kernels") == len(coverage.MATRIX_OPS), rows[point]
    assert "build `--head-dim 256 --block-size 128`" in rows[("| 256", "128")]
