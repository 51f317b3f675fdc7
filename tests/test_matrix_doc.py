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


def test_matrix_marks_the_refused_head_dim():
    table = coverage.matrix_table()
    rows = {tuple(r.split(" | ")[:2]): r for r in table.splitlines()[2:]}
    assert "reference / reference" in rows[("| 256", "128")] and "yes" in rows[("| 128", "128")]
    assert rows[("| 128", "128")].count("kernels / kernels") == len(coverage.MATRIX_OPS)
