"""Warp-stall samples per SASS instruction from an Nsight Compute report's source page, on the CPU machine:

    ncu --set full -o prof ...; ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_stalls.py sass.csv [kernel index] [--top N]

Prints each kernel's share of samples per stall reason and its top instructions (sample share, two main
reasons, SASS); --all prints every instruction in order (to read a loop's phases).
"""

import argparse
import csv

REASONS = ("barrier", "branch_resolving", "dispatch", "drain", "imc", "lg", "long_sb", "math", "membar", "mio",
           "misc", "no_inst", "not_selected", "selected", "short_sb", "sleep", "tex", "wait")


def kernels(path):
    out, cur = [], None
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            cur = {"name": row[1], "rows": []}
            out.append(cur)
        elif row and row[0] == "Address":
            cur["header"] = row
        elif cur is not None and row:
            cur["rows"].append(row)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("kernel", nargs="?", type=int)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()
    for n, k in enumerate(kernels(a.csv)):
        if a.kernel is not None and n != a.kernel:
            continue
        h = k["header"]
        samples = h.index("Warp Stall Sampling (All Samples)")
        cols = {r: h.index("stall_" + r) for r in REASONS if "stall_" + r in h}
        val = lambda row, i: int(row[i] or 0)  # noqa: E731
        total = max(1, sum(val(r, samples) for r in k["rows"]))
        share = {r: sum(val(row, i) for row in k["rows"]) / total for r, i in cols.items()}
        print(f"[{n}] {k['name'][:100]}\n  samples {total}: " + ", ".join(
            f"{r} {100 * s:.0f}%" for r, s in sorted(share.items(), key=lambda x: -x[1]) if s >= 0.005))
        lines = []
        for i, row in enumerate(k["rows"]):
            s = val(row, samples)
            top = sorted(((val(row, c), r) for r, c in cols.items()), reverse=True)[:2]
            lines.append((s, f"  {i:5d} {100 * s / total:5.2f}% {' '.join(f'{r}:{v}' for v, r in top if v):30s} "
                             f"{row[1].strip()}"))
        for s, text in (lines if a.all else sorted(lines, key=lambda x: -x[0])[:a.top]):
            print(text)


if __name__ == "__main__":
    main()
