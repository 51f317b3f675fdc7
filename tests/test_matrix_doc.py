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
    """D 256 runs every op on sm90a's kernels and only the selection on sm100a's (mma.sync spills there); the
    build command it names builds for sm90a."""
    table = coverage.matrix_table()
    rows = {tuple(r.split(" | ")[:2]): r for r in table.splitlines()[2:]}
    assert "yes" in rows[("| 128", "128")]
    assert rows[("| 128", "128")].count("kernels / kernels") == len(coverage.MATRIX_OPS)
    wide = rows[("| 256", "128")]
    assert "`--arch sm90a --head-dim 256 --block-size 128` (sm100a: refused)" in wide
    assert wide.count("kernels / reference") == len(coverage.MATRIX_OPS) - 1 and "kernels / kernels" in wide
