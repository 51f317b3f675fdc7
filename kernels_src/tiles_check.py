"""Host-side check of tiles.cp_async_rows' thread layouts (build-time, no GPU), on cute's own partitions: for every
threads / row_threads pair the kernels use, the copy covers each element of a (rows x cols) tile exactly once; a
thread's chunk is 8 contiguous elements of one row; at each of a thread's passes and copies, the row's threads read
row_threads * 8 contiguous elements (one instruction's bytes of that row stay contiguous); and each row of a pass
has exactly one thread whose first copy starts at column 0 (the "lead" thread that the gathers give per-row words).
Run by tests/test_build_sparse.py."""

import cutlass
import cutlass.cute as cute

from kernels_src.tiles import cp_async_rows

CASES = ((256, None), (256, 8), (256, 4), (128, None), (128, 8), (128, 4), (32, 4))  # (threads, row_threads)
ROWS, COLS = 64, 128


@cute.jit
def _collect(threads: cutlass.Constexpr, row_threads: cutlass.Constexpr, out: cutlass.Constexpr):
    copy = cp_async_rows(cutlass.BFloat16, COLS, threads, row_threads)
    for t in cutlass.range_constexpr(threads):
        c = copy.get_slice(t).partition_S(cute.make_identity_tensor((ROWS, COLS)))
        out.append([[[c[v, m, kk] for v in range(cute.size(c, mode=[0]))] for kk in range(cute.size(c, mode=[2]))]
                    for m in range(cute.size(c, mode=[1]))])


def mismatches() -> list[str]:
    errors = []
    for threads, row_threads in CASES:
        per_thread: list = []
        _collect(threads, row_threads, per_thread)
        per_row = min(COLS // 8, row_threads or COLS)
        name = f"threads {threads}, row_threads {row_threads}"
        seen = {}
        for t, passes in enumerate(per_thread):
            for m, copies in enumerate(passes):
                for kk, chunk in enumerate(copies):
                    rows = {x[0] for x in chunk}
                    cols = [x[1] for x in chunk]
                    if len(rows) != 1 or cols != list(range(cols[0], cols[0] + 8)):
                        errors.append(f"{name}: thread {t} pass {m} copy {kk} is not 8 contiguous elements of a row")
                    for x in chunk:
                        seen[tuple(x)] = seen.get(tuple(x), 0) + 1
                    # one instruction: this row's per_row threads read [c0, c0 + 8 per_row) at the same (m, kk)
                    peers = [per_thread[u][m][kk] for u in range(threads) if per_thread[u][m][kk][0][0] == chunk[0][0]]
                    starts = sorted(p[0][1] for p in peers)
                    if starts != list(range(starts[0], starts[0] + 8 * per_row, 8)):
                        errors.append(f"{name}: pass {m} copy {kk} of row {chunk[0][0]} reads columns {starts}")
            for m, copies in enumerate(passes):
                row = copies[0][0][0]
                leads = [u for u in range(threads) if per_thread[u][m][0][0] == (row, 0)]
                if len(leads) != 1:
                    errors.append(f"{name}: pass {m}, row {row} has lead threads {leads}")
        if len(seen) != ROWS * COLS or set(seen.values()) != {1}:
            errors.append(f"{name}: {len(seen)} of {ROWS * COLS} elements copied, counts {sorted(set(seen.values()))}")
    return errors
