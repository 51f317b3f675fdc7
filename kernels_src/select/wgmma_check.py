"""Host-side check of the wide selection kernel's register layout (build time, no GPU), on cute's own partition:
ProxySelectWGWide takes block 2 js's maximum from the first half of a thread's accumulator columns and block
2 js + 1's from the second half (kernels_src/select/wgmma.py). Run by tests/test_build_select.py
(CUTE_DSL_ARCH=sm_90a: wgmma atoms need it when traced on a CPU)."""

import cutlass
import cutlass.cute as cute

from kernels_src.select import Config
from kernels_src.select.wgmma import ProxySelectWGWide
from kernels_src.tiles import WARPGROUP_ROWS, wg_acc_rows_cols


@cute.jit
def _collect(out: cutlass.Constexpr):
    kernel = ProxySelectWGWide(Config(block_size=64, max_k=64, mma="wgmma", schedule="wide"))
    shape = (WARPGROUP_ROWS, kernel.block_size)  # one 64-row half's product over a step's 128 keys
    for t in cutlass.range_constexpr(kernel.threads):
        mn = wg_acc_rows_cols(kernel._wg_mma().get_slice(t).partition_C(cute.make_identity_tensor(shape)))
        out.append([[mn[r, c] for c in range(cute.size(mn, mode=[1]))] for r in range(cute.size(mn, mode=[0]))])


def wide_mismatches() -> list[str]:
    """Empty when, for all 128 threads, each accumulator row is one row, its first half of columns are keys 0-63 and
    its second half keys 64-127, and a quad's four lanes cover each of a row's 128 keys exactly once."""
    per_thread: list = []
    _collect(per_thread)
    errors = []
    for t, rows in enumerate(per_thread):
        for r, row in enumerate(rows):
            if len({x[0] for x in row}) != 1:
                errors.append(f"thread {t}: row {r} spans rows {sorted({x[0] for x in row})}")
            half = len(row) // 2
            if not (all(x[1] < 64 for x in row[:half]) and all(x[1] >= 64 for x in row[half:])):
                errors.append(f"thread {t}: row {r}'s columns {[x[1] for x in row]} are not keys 0-63 then 64-127")
    for q0 in range(0, len(per_thread), 4):
        for r in range(len(per_thread[q0])):
            keys = sorted(x[1] for t in range(q0, q0 + 4) for x in per_thread[t][r])
            if keys != list(range(128)):
                errors.append(f"quad of threads {q0}-{q0 + 3}: row {r} covers keys {keys[:6]}... not 0-127 once")
    return errors
