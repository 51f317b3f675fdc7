"""A GPU test run's record for benchmarks/results (gpu_tests.json): every test id and its outcome from pytest's
JUnit XML, the counts, and the compute-sanitizer summaries, with the commit, device and command given.

Usage (on the CPU machine, with the XML and sanitizer logs a device call brought back):
    python benchmarks/gpu_test_record.py gpu_tests.xml --commit HASH --device "NVIDIA H100 80GB HBM3" \
        --command "..." [--sanitizer-log san_memcheck.log ...] [--out benchmarks/results/gpu_tests.json]
"""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

SUMMARY = re.compile(r"(ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: .*)$")


def outcomes(xml_path: Path) -> dict[str, str]:
    """test id -> "passed", "failed", "error" or "skipped: <reason>"."""
    result = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if bad is None:
            result[tid] = "passed"
        elif bad.tag == "skipped":
            result[tid] = "skipped: " + (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") \
                else "skipped"
        else:
            result[tid] = {"failure": "failed", "error": "error"}[bad.tag]
    return result


def sanitizer_lines(path: Path) -> list[str]:
    """Each summary line of a compute-sanitizer log, prefixed with the tool named in the file name."""
    tool = path.stem.removeprefix("san_")
    return [f"[{tool}] {m.group(1)}" for line in path.read_text(errors="replace").splitlines()
            if (m := SUMMARY.search(line))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml", type=Path)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--sanitizer-log", type=Path, nargs="*", default=[])
    ap.add_argument("--sanitizer-command", default="")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_tests.json")
    a = ap.parse_args(argv)
    table = outcomes(a.xml)
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for outcome in table.values():
        counts[outcome.split(":")[0]] += 1
    record = dict(what=f"GPU test run on the {a.device}: every test id and its outcome (pytest -m gpu over tests/)",
                  commit=a.commit, command=a.command, device=a.device, counts=counts)
    if a.sanitizer_log:
        record["sanitizers"] = dict(command=a.sanitizer_command,
                                    results=[line for p in a.sanitizer_log for line in sanitizer_lines(p)])
    record["outcomes"] = table
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{a.out}: {counts}")


if __name__ == "__main__":
    main()
