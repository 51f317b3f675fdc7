"""Host-side check of the wgmma forward's register reuse (build-time, no GPU): for every thread, the P operand
built from the QK accumulator by wgmma.wg_acc_as_a reads, at each A-fragment position, the accumulator register
whose (row, key) is the one the PV MMA expects there; and wg_acc_rows_cols splits the accumulator into rows and
columns. Run by tests/test_build_sparse.py (CUTE_DSL_ARCH=sm_90a: wgmma atoms need it when traced on a CPU)."""

import cutlass
import cutlass.cute as cute

from kernels_src.sparse_fwd import Config
from kernels_src.sparse_fwd.wgmma import SparseAttentionWG, wg_acc_as_a, wg_acc_rows_cols


@cute.jit
def _collect(out: cutlass.Constexpr):
    kernel = SparseAttentionWG(Config(mma="wgmma"))
    qk, pv = kernel._tiled_mma(), kernel._tiled_mma_pv()
    shape = (kernel.tile_m, kernel.block_size)
    for t in cutlass.range_constexpr(kernel.threads):
        c = qk.get_slice(t).partition_C(cute.make_identity_tensor(shape))
        a = pv.get_slice(t).partition_A(cute.make_identity_tensor(shape))
        reuse = cute.make_tensor(c.iterator, wg_acc_as_a(c.layout))
        mn = wg_acc_rows_cols(c)
        out.append((
            [a[j] for j in range(cute.size(a))],
            [reuse[j] for j in range(cute.size(reuse))],
            [[mn[r, k] for k in range(cute.size(mn, mode=[1]))] for r in range(cute.size(mn, mode=[0]))],
        ))


def mismatches() -> list[str]:
    """Empty when the register reuse and the row / column split are right for all 256 threads."""
    per_thread: list = []
    _collect(per_thread)
    errors = []
    for t, (want, got, rows) in enumerate(per_thread):
        if [tuple(x) for x in want] != [tuple(x) for x in got]:
            errors.append(f"thread {t}: P operand coordinates {got[:4]}... != {want[:4]}...")
        for r, row in enumerate(rows):
            if len({x[0] for x in row}) != 1:
                errors.append(f"thread {t}: row {r} spans several rows {sorted({x[0] for x in row})}")
        if len({x[1] for x in rows[0]}) != len(rows[0]):
            errors.append(f"thread {t}: the columns of a row repeat")
    return errors
