"""Pieces every mma.sync tile kernel here uses (CuTeDSL; imported by kernel modules only, at build time).

- shared-memory tiles: K-major 128B-swizzled layouts, and their transposed views for ldmatrix.trans;
- the warp-level MMA (m16n8k16) tiled over warps, and views of its accumulator: rows x columns of one thread,
  and the same registers as the A operand of the next product (register reuse of P);
- cp.async of 16-byte chunks, and one gathered gmem row into a thread's smem partition;
- row scalars staged beside a gathered tile: one 4-byte cp.async per (row, scalar) into a small smem table, so a
  row's statistics (the proxy backward's lse_g, lse_p, kl_grad) are in shared memory when the tile's barrier
  passes instead of being two dependent global loads after the tile's product;
- a work item's plan entries (queries, destinations) staged once in a shared table, so that every tile reads
  them there instead of starting with a dependent global load (item_words, item_word);
- for the wgmma kernels (sm90a): views of the warpgroup MMA accumulator (rows x columns, and as the register A
  operand of the next product).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from kernels_src.constants import WARPGROUP_THREADS


def smem_tile(dtype, shape):
    """K-major, 128B-swizzled smem layout of shape (rows, cols[, stages]): what cp.async / TMA write and ldmatrix
    reads without bank conflicts (8 rows x 64 16-bit elements per swizzle atom)."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
    return cute.tile_to_shape(atom, shape, tuple(range(len(shape))))


def transposed(t: cute.Tensor) -> cute.Tensor:
    """The (cols, rows) view of a swizzled (rows, cols) smem tile: same bytes, modes swapped."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))


def warp_mma(dtype, warps_m: int, warps_n: int):
    """mma.sync 16x8x16 with fp32 accumulators, warps_m x warps_n warps; each warp's N is in 16-column units, so
    one ldmatrix.x4 feeds two n8 MMAs."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)),
        (warps_m, warps_n, 1),
        permutation_mnk=(warps_m * 16, warps_n * 16, 16),
    )


def cp_async_rows(dtype, cols: int, threads: int, row_threads: int | None = None):
    """cp.async of 16-byte chunks, row_threads threads per row (default and at most cols / 8), threads /
    row_threads rows per pass. Thread t of a row takes chunks t, t + row_threads, ...: one instruction still reads
    row_threads * 16 contiguous bytes of each row. Gathers with fewer threads per row give each thread fewer,
    longer rows, and a gathered row costs its thread a dependent plan load and 64-bit address math (the KL pass
    at G = 16: 4 threads per row 1.53x faster than 16; NOTES.md)."""
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=128)
    per_row = min(cols // 8, row_threads or cols)
    thr = cute.make_ordered_layout((threads // per_row, per_row), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, 8)))


def acc_rows_cols(t: cute.Tensor) -> cute.Tensor:
    """((2, 2), MMA_M, MMA_N) accumulator -> ((2, MMA_M), (2, MMA_N)): the rows x columns one thread holds."""
    lay = t.layout
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])),
    )
    return cute.make_tensor(t.iterator, mn)


def acc_as_frg_a(lay):
    """((2, 2), MMA_M, MMA_N) accumulator layout -> ((2, 2, 2), MMA_M, MMA_N / 2) A-operand layout: the two n8
    tiles 2k and 2k + 1 hold exactly the registers of the k16 A fragment k (mma.sync m16n8k16)."""
    d = cute.logical_divide(lay, (None, None, 2))
    return cute.make_layout(
        ((d.shape[0][0], d.shape[0][1], d.shape[2][0]), d.shape[1], d.shape[2][1]),
        stride=((d.stride[0][0], d.stride[0][1], d.stride[2][0]), d.stride[1], d.stride[2][1]),
    )


@cute.jit
def copy_row(gcopy, dtype: cutlass.Constexpr, g_row: cute.Tensor, t_s, t_c, m):
    """This thread's 16-byte chunks of one gmem row into pass m of its smem partition. The runtime guarantees
    16-byte aligned rows (unit-stride head dim, 16-byte multiple strides), which the address math cannot see."""
    ptr = cute.make_ptr(dtype, g_row.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
    chunks = cute.tiled_divide(cute.make_tensor(ptr, cute.make_layout(cute.size(g_row))), (8,))
    for kk in cutlass.range_constexpr(cute.size(t_s, mode=[2])):
        cute.copy(gcopy, chunks[None, t_c[0, 0, kk][1] // 8], t_s[None, m, kk])


@cute.jit
def load_rows(gcopy, dtype: cutlass.Constexpr, g_rows: cute.Tensor, s_tile: cute.Tensor, r0, n_rows, tidx):
    """cp.async rows [r0, r0 + rows) of g_rows (n_rows x cols, unit-stride columns) into the swizzled smem tile
    (rows x cols); rows past n_rows are zero-filled (no garbage, which could be NaN, enters a product)."""
    thr = gcopy.get_slice(tidx)
    t_s = thr.partition_D(s_tile)
    t_c = thr.partition_S(cute.make_identity_tensor((cute.size(s_tile, mode=[0]), cute.size(s_tile, mode=[1]))))
    for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
        t = r0 + t_c[0, m, 0][0]
        if t < n_rows:
            copy_row(gcopy, dtype, g_rows[t, None], t_s, t_c, m)
        else:
            t_s[None, m, None].fill(0)


def cp_async_word(dtype):
    """cp.async of one 4-byte element (.ca: the only cache mode cp.async has below 16 bytes)."""
    return cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), dtype,
                               num_bits_per_copy=32)


def row_table(rows: int, stages: int, fields: int):
    """(rows, stages, fields) compact layout of a staged per-row scalar table (one 4-byte word per entry)."""
    return cute.make_layout((rows, stages, fields))


@cute.jit
def copy_word(atom, g_vec: cute.Tensor, index, s_table: cute.Tensor, row, stage, field: cutlass.Constexpr):
    """cp.async g_vec[index] -> s_table[row, stage, field]; g_vec is a unit-stride 1-D gmem view (a (b, h) row of
    an lse-like (B, heads, S) tensor, or the plan's entry list)."""
    src = cute.make_tensor(g_vec.iterator + index, cute.make_layout(1))
    dst = cute.make_tensor(s_table.iterator + cute.crd2idx((row, stage, field), s_table.layout), cute.make_layout(1))
    cute.copy(atom, src, dst)


@cute.jit
def stage_item_words(g_vec: cute.Tensor, s_table: cute.Tensor, start, n, tidx, threads: cutlass.Constexpr):
    """cp.async the item's words g_vec[start + e], e < min(n, table size), into s_table (4-byte Int32 words, one
    per copy: an item's first entry has no alignment); the caller commits the group."""
    word = cp_async_word(cutlass.Int32)
    for e in cutlass.range(tidx, cutlass.min(n, cute.size(s_table)), threads, unroll=1):
        cute.copy(word, cute.make_tensor(g_vec.iterator + start + e, cute.make_layout(1)),
                  cute.make_tensor(s_table.iterator + e, cute.make_layout(1)))


@cute.jit
def item_word(g_vec: cute.Tensor, s_table: cute.Tensor, start, e):
    """The item's word e: from the shared table, or past it from global memory."""
    v = cutlass.Int32(0)
    if e < cute.size(s_table):
        v = s_table[e]
    else:
        v = g_vec[start + e]
    return v


WARPGROUP_ROWS = 64


def warpgroup_of(tidx):
    """(warpgroup, thread within it) of CTA thread tidx."""
    return tidx // WARPGROUP_THREADS, tidx % WARPGROUP_THREADS


def wg_acc_rows_cols(t: cute.Tensor) -> cute.Tensor:
    """wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) -> ((2, MMA_M), (2, N/8, MMA_N)): rows x columns of one
    thread. Value modes: column pair, row + 8, n8 tile (cute's GMMA C layout), as mma.sync's plus the n8 tiles."""
    lay = t.layout
    v_shape, v_stride = lay.shape[0], lay.stride[0]
    mn = cute.make_layout(
        ((v_shape[1], lay.shape[1]), (v_shape[0], v_shape[2], lay.shape[2])),
        stride=((v_stride[1], lay.stride[1]), (v_stride[0], v_stride[2], lay.stride[2])),
    )
    return cute.make_tensor(t.iterator, mn)


def wg_acc_as_a(lay):
    """wgmma accumulator layout ((2, 2, N/8), MMA_M, MMA_N) -> the register A operand's ((2, 2, 2), MMA_M,
    (MMA_N, N/16)): the k16 step k reads n8 tiles 2k and 2k + 1 (A values: k pair, row + 8, k + 8)."""
    v_shape, v_stride = lay.shape[0], lay.stride[0]
    return cute.make_layout(
        ((v_shape[0], v_shape[1], 2), lay.shape[1], (lay.shape[2], v_shape[2] // 2)),
        stride=((v_stride[0], v_stride[1], v_stride[2]), lay.stride[1], (lay.stride[2], 2 * v_stride[2])),
    )


def tile_storage(dtype, layout):
    """A SharedStorage (cute.struct) field for one `layout` of dtype, 1024-byte aligned: the period of the 128-byte
    swizzle, so that every swizzled tile, TMA box and wgmma descriptor starts on an atom."""
    return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]


class RowLanes:
    """Base of the kernels that give each (b, i, h) row of D elements to D / 8 lanes (kernels_src.row_lanes:
    bwd_delta, grad_cast): the row arithmetic and a lane's 16-byte-aligned slice of a row."""

    def __init__(self, config):
        from kernels_src.constants import DTYPES
        from kernels_src.row_lanes import ELEMS_PER_LANE, lanes_per_row, rows_per_cta

        self.dtype = DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.threads = config.threads
        self.per_lane = ELEMS_PER_LANE
        self.lanes = lanes_per_row(config)
        self.rows = rows_per_cta(config)
        self.traced = {"smem_bytes": 0}

    @cute.jit
    def lane_slice(self, dtype: cutlass.Constexpr, row_view, sub):
        """Lane sub's per_lane elements of a row, on a 16-byte aligned pointer (vectorised access; the runtime
        passes rows on 16-byte boundaries)."""
        ptr = cute.make_ptr(dtype, row_view.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
        return cute.local_tile(cute.make_tensor(ptr, cute.make_layout(self.head_dim)), (self.per_lane,), (sub,))
