"""Facts stated once, cited with their evidence: every benchmarks/results file the README and docs/ cite exists, every
JSON there is cited somewhere (README, docs/, a family's NOTES.md, examples/README.md), and no page links outside the
repository's own files (relative links resolve)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ELSEWHERE = [*sorted((REPO / "kernels_src").glob("*/NOTES.md")), REPO / "examples" / "README.md"]
CITED_PATH = re.compile(r"benchmarks/results/([\w.-]+\.(?:json|png))")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_cited_result_exists():
    missing = [(p.name, name) for p in DOCS for name in CITED_PATH.findall(p.read_text())
               if not (RESULTS / name).is_file()]
    assert not missing, missing


def test_every_result_json_is_cited():
    text = "\n".join(p.read_text() for p in DOCS + ELSEWHERE)
    uncited = [p.name for p in sorted(RESULTS.glob("*.json")) if not re.search(rf"(?<![\w-]){re.escape(p.name)}", text)]
    assert not uncited, f"benchmarks/results JSON cited nowhere: {uncited}"


def test_links_stay_inside_the_repository():
    bad = []
    for p in DOCS:
        for target in LINK.findall(p.read_text()):
            if re.match(r"[a-z]+:", target):
                bad.append((p.name, target))
            elif not (p.parent / target).resolve().is_relative_to(REPO) or not (p.parent / target).exists():
                bad.append((p.name, target))
    assert not bad, bad
