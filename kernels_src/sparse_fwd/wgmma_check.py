"""Host-side checks of the wgmma kernels' register layouts (build-time, no GPU), on cute's own partitions:
- forward: for every thread, the P operand built from the QK accumulator by wgmma.wg_acc_as_a reads, at each
  A-fragment position, the accumulator register whose (row, key) is the one the PV MMA expects there; and
  wg_acc_rows_cols splits the accumulator into rows and columns; the epilogue's quad transpose (store_row) finds
  value c of lane q's row at column 8 (c // 2) + 2 q + c % 2, the quad's four lanes on one row;
- KL pass: a thread's score columns lie in its warpgroup's 32 keys (the key group its (A, T, L) shares are written
  for) and each quad of lanes covers those 32 keys of its rows exactly once (the quad shuffles sum a group); in
  ping-pong, each quad of a warpgroup covers all the block's keys of its rows once;
- proxy backward: dq_p's MMA (B MN-major) partitions its (queries x D) accumulator exactly as the score MMA whose
  partition the kernel uses for the dq_p staging coordinates.
Run by tests/test_build_sparse.py (CUTE_DSL_ARCH=sm_90a: wgmma atoms need it when traced on a CPU)."""

import cutlass
import cutlass.cute as cute

from kernels_src import sparse_kl
from kernels_src.sparse_fwd import Config
from kernels_src.sparse_fwd.wgmma import SparseAttentionWG, wg_acc_as_a, wg_acc_rows_cols
from kernels_src.sparse_bwd_proxy.wgmma import SparseProxyBackwardWG
from kernels_src.sparse_kl.pingpong import SparseKLPingPong
from kernels_src.sparse_kl.wgmma import SparseKLWG


def _thread_rows(mma, shape, t) -> list:
    """Thread t's accumulator coordinates (row, column) of mma over a tile of shape, row by row (traced)."""
    mn = wg_acc_rows_cols(mma.get_slice(t).partition_C(cute.make_identity_tensor(shape)))
    return [[mn[r, c] for c in range(cute.size(mn, mode=[1]))] for r in range(cute.size(mn, mode=[0]))]


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


@cute.jit
def _collect_epilogue(out: cutlass.Constexpr):
    kernel = SparseAttentionWG(Config(mma="wgmma"))
    pv = kernel._tiled_mma_pv()
    for t in cutlass.range_constexpr(kernel.threads):
        out.append(_thread_rows(pv, (kernel.tile_m, kernel.head_dim), t))


def epilogue_mismatches() -> list[str]:
    """Empty when the O accumulator's columns are where SparseAttentionWG.store_row's transpose assumes them: lane q
    of a quad holds its row's columns 8 (c // 2) + 2 q + c % 2 (c = 0 .. 2 D / 8 - 1), and the quad shares its rows."""
    per_thread: list = []
    _collect_epilogue(per_thread)
    errors = []
    for t, rows in enumerate(per_thread):
        q = t % 4
        for r, row in enumerate(rows):
            cols = [x[1] for x in row]
            if cols != [8 * (c // 2) + 2 * q + c % 2 for c in range(len(row))]:
                errors.append(f"thread {t}: row {r} columns {cols[:4]}... not 8 (c // 2) + 2 q + c % 2")
            if len({x[0] for x in row}) != 1 or row[0][0] != per_thread[t - q][r][0][0]:
                errors.append(f"thread {t}: row {r} is not its quad's row")
    return errors


@cute.jit
def _collect_kl(out: cutlass.Constexpr):
    kernel = SparseKLWG(sparse_kl.Config(mma="wgmma"))
    mma = kernel._score_mma()
    for t in cutlass.range_constexpr(kernel.threads):
        out.append(_thread_rows(mma, (kernel.tile_m, kernel.tile_n), t))


def kl_mismatches() -> list[str]:
    """Empty when every thread's KL score columns sit in its warpgroup's key group and quads cover it once."""
    per_thread: list = []
    _collect_kl(per_thread)
    errors = []
    for t, rows in enumerate(per_thread):
        group = t // 128
        for r, row in enumerate(rows):
            if len({x[0] for x in row}) != 1:
                errors.append(f"thread {t}: row {r} spans several queries")
            if any(not 32 * group <= x[1] < 32 * group + 32 for x in row):
                errors.append(f"thread {t}: keys {sorted(x[1] for x in row)} outside group {group}")
    for quad in range(0, len(per_thread), 4):
        for r in range(len(per_thread[quad])):
            keys = sorted(x[1] for t in range(quad, quad + 4) for x in per_thread[t][r])
            if keys != list(range(32 * (quad // 128), 32 * (quad // 128) + 32)):
                errors.append(f"quad {quad // 4}, row {r}: keys {keys[:6]}... do not cover the group once")
    return errors


@cute.jit
def _collect_kl_pingpong(out: cutlass.Constexpr):
    kernel = SparseKLPingPong(sparse_kl.Config(mma="wgmma", tile_n=128, stages=1, schedule="pingpong"))
    mma = kernel._wg_score_mma()
    for t in cutlass.range_constexpr(128):  # one warpgroup: the MMA is issued with tidx % 128
        out.append(_thread_rows(mma, (kernel.tile_m, kernel.tile_n), t))


def kl_pingpong_mismatches() -> list[str]:
    """Empty when each quad of the ping-pong KL pass's warpgroup covers the 128 keys of each of its rows once and a
    thread's row holds one query (its row statistics are quad shuffles over one (A, T, L) group)."""
    per_thread: list = []
    _collect_kl_pingpong(per_thread)
    errors = []
    for quad in range(0, len(per_thread), 4):
        for r in range(len(per_thread[quad])):
            cells = [x for t in range(quad, quad + 4) for x in per_thread[t][r]]
            if len({x[0] for x in cells}) != 1:
                errors.append(f"quad {quad // 4}, row {r}: spans several queries")
            if sorted(x[1] for x in cells) != list(range(128)):
                errors.append(f"quad {quad // 4}, row {r}: keys do not cover the block once")
    return errors


@cute.jit
def _collect_proxy(out: cutlass.Constexpr):
    kernel = SparseProxyBackwardWG(sparse_kl.Config(mma="wgmma"))
    score, dq = kernel._score_mma(), kernel._dq_mma()
    shape = (kernel.tile_m, kernel.head_dim)
    for t in cutlass.range_constexpr(kernel.threads):
        a = score.get_slice(t).partition_C(cute.make_identity_tensor(shape))
        b = dq.get_slice(t).partition_C(cute.make_identity_tensor(shape))
        out.append(([a[j] for j in range(cute.size(a))], [b[j] for j in range(cute.size(b))]))


def proxy_mismatches() -> list[str]:
    """Empty when the dq_p MMA's accumulator partition is the score MMA's, thread by thread."""
    per_thread: list = []
    _collect_proxy(per_thread)
    return [f"thread {t}: dq_p partition {b[:3]}... != score partition {a[:3]}..."
            for t, (a, b) in enumerate(per_thread) if [tuple(x) for x in a] != [tuple(x) for x in b]]
