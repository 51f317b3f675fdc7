"""The reverse index's counting sort (CuTeDSL): kernels_src/plan_lists/__init__.py says what and why.

One CTA per tile of 128 query rows of one (b, p), thread t on row r = tile * 128 + t. Shared memory holds the
tile's bitmap of one window of blocks: word (j - w0) * 4 + t // 32, bit t % 32, set when row r chose block j
(a live slot: 0 <= j <= r // Bs). A block's words give its list's count in the tile (popc) and each row's rank
among them (popc of the bits below the row).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream

from kernels_src.block_scores.kernel import compile_kernel
from kernels_src.plan_lists import TILE_ROWS, WINDOW_BLOCKS, params
from kernels_src.spec import Compiled, fake_tensor

_WORDS = TILE_ROWS // 32  # bitmap words per block
_WARPS = TILE_ROWS // 32


@cute.jit
def exclusive_scan(s_warp, d, warps: cutlass.Constexpr):
    """(the sum of d over the threads below this one, the sum over the CTA) for a CTA of `warps` warps: a warp
    scan by shuffles, then the warps' totals through s_warp (warps words; one barrier)."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = tidx % 32
    warp = tidx // 32
    incl = d
    off = 1
    while off < 32:  # unrolled at trace time
        up = cute.arch.shuffle_sync_up(incl, offset=off)
        if lane >= off:
            incl += up
        off *= 2
    if lane == 31:
        s_warp[warp] = incl
    cute.arch.sync_threads()
    below = incl - d
    total = cutlass.Int32(0)
    for w in cutlass.range_constexpr(warps):
        v = s_warp[w]
        total += v
        if w < warp:
            below += v
    return below, total


class TileKeys:
    """Trace-time handles of where one tile's entries go: its (b, p), rows, chunk and keys."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class PlanLists:
    def __init__(self, config):
        self.block_size = config.block_size
        self.max_k = config.max_k
        self.phase = config.phase
        self.threads = config.threads
        self.traced = {"smem_bytes": 0}

    def _storage(self):
        @cute.struct
        class SharedStorage:
            s_bits: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, WINDOW_BLOCKS * _WORDS], 16]
            s_base: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, WINDOW_BLOCKS], 16]
            s_warp: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2 * _WARPS], 16]

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        return SharedStorage

    def _launch(self, block_indices, stream):
        B, Hp, S, _ = block_indices.shape
        return dict(grid=(B * Hp * cute.ceil_div(S, TILE_ROWS), 1, 1), block=(self.threads, 1, 1),
                    smem=self.traced["smem_bytes"], stream=stream)

    @cute.jit
    def count(self, block_indices: cute.Tensor, counts: cute.Tensor, heads: cutlass.Int32, queries: cutlass.Int32,
              tiles: cutlass.Int32, stream: cuda.CUstream):
        storage = self._storage()
        self.kernel_count(block_indices, counts, heads, queries, tiles, storage).launch(
            **self._launch(block_indices, stream))

    @cute.jit
    def scatter(self, block_indices: cute.Tensor, counts: cute.Tensor, ends: cute.Tensor, entry_query: cute.Tensor,
                entry_dest: cute.Tensor, lists: cute.Tensor, heads: cutlass.Int32, queries: cutlass.Int32,
                tiles: cutlass.Int32, stream: cuda.CUstream):
        storage = self._storage()
        self.kernel_scatter(block_indices, counts, ends, entry_query, entry_dest, lists, heads, queries, tiles,
                            storage).launch(**self._launch(block_indices, stream))

    # --- where a tile's entries go ------------------------------------------------------------------------------

    @cute.jit
    def tile_keys(self, block_indices, heads: cutlass.Int32, queries: cutlass.Int32, tiles: cutlass.Int32):
        """This CTA's tile: (b, p), the chunk (head group hg = p // c, query chunk qc) and its key bases.

        Keys, chunk-major: chunk (hg, qc) holds B c (NB_c + 1) keys, its lists (b, p', j) for j < NB_c =
        ceil(q_hi / Bs), then one dead key per (b, p'). Every query chunk but the last holds Q queries, so the
        keys before a chunk are closed forms: sum over qc' < qc of B c (NB(qc') + 1), NB(qc') = (qc' + 1) Q / Bs.
        flash_msa_rt.ops.sparse_plan.gpu_chunk_keys is the host's statement of the same sizes."""
        cta, _, _ = cute.arch.block_idx()
        B, Hp, S, _ = block_indices.shape
        Bs = self.block_size
        per_bp = cute.ceil_div(S, TILE_ROWS)
        bp = cta // per_bp
        t = cta - bp * per_bp
        b = bp // Hp
        p = bp - b * Hp
        hg = p // heads
        pc = p - hg * heads
        r0 = t * TILE_ROWS
        qc = r0 // queries
        q_lo = qc * queries
        q_hi = cutlass.min(S, q_lo + queries)
        nb = cute.ceil_div(q_hi, Bs)
        n_q = cute.ceil_div(S, queries)
        nbq = queries // Bs
        bc = B * heads
        per_group = bc * (nbq * (n_q - 1) * n_q // 2 + cute.ceil_div(S, Bs) + n_q)
        kbase = hg * per_group + bc * (nbq * qc * (qc + 1) // 2 + qc)
        return TileKeys(b=b, p=p, pc=pc, r0=r0, q_lo=q_lo, length=q_hi - q_lo, nb=nb, kbase=kbase,
                        first_list=kbase + (b * heads + pc) * nb, dead_key=kbase + bc * nb + b * heads + pc,
                        column=t - q_lo // TILE_ROWS, chunk=hg * n_q + qc, bc=bc,
                        nb_tile=cutlass.min(nb, (cutlass.min(r0 + TILE_ROWS, S) - 1) // Bs + 1))

    @cute.jit
    def load_slots(self, block_indices, tk, r, row_live):
        """Row r's K slots in registers (max_k of them; slots past K, and rows past S, are never read): issued
        together, where a loop over K would wait for each load in turn."""
        K = block_indices.shape[3]
        slots = cute.make_rmem_tensor(self.max_k, cutlass.Int32)
        for k in cutlass.range_constexpr(self.max_k):
            v = cutlass.Int32(-1)
            if row_live and k < K:
                v = block_indices[tk.b, tk.p, r, k]
            slots[k] = v
        return slots

    @cute.jit
    def dead_slots(self, slots, K, r, row_live):
        """Slots of row r that enter no list (-1, or a block past the row's own)."""
        n = cutlass.Int32(0)
        if row_live:
            for k in cutlass.range_constexpr(self.max_k):
                if k < K:
                    j = slots[k]
                    if j < 0 or j > r // self.block_size:
                        n += 1
        return n

    @cute.jit
    def fill_window(self, slots, K, s_bits, r, row_live, w0, n_win):
        """The window's bitmap: cleared, then one bit per (row, live slot) with w0 <= j < w0 + n_win."""
        tidx, _, _ = cute.arch.thread_idx()
        for w in cutlass.range(tidx, n_win * _WORDS, self.threads, unroll=1):
            s_bits[w] = cutlass.Int32(0)
        cute.arch.sync_threads()
        if row_live:
            bit = cutlass.Int32(1) << (tidx % 32)
            for k in cutlass.range_constexpr(self.max_k):
                if k < K:
                    j = slots[k]
                    if j >= w0 and j < w0 + n_win and j <= r // self.block_size:
                        cute.arch.atomic_or(s_bits.iterator + ((j - w0) * _WORDS + tidx // 32), bit)
        cute.arch.sync_threads()

    @cute.jit
    def block_count(self, s_bits, jj):
        n = cutlass.Int32(0)
        for w in cutlass.range_constexpr(_WORDS):
            n += cute.arch.popc(s_bits[jj * _WORDS + w])
        return n

    @cute.jit
    def dead_prefix(self, s_warp, d):
        """(rows below this one's dead slots, the tile's dead slots): a block-wide exclusive scan of d."""
        return exclusive_scan(s_warp, d, _WARPS)

    # --- phase 1: counts -----------------------------------------------------------------------------------------

    @cute.kernel
    def kernel_count(self, block_indices, counts, heads: cutlass.Int32, queries: cutlass.Int32,
                     tiles: cutlass.Int32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        S = block_indices.shape[2]
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_bits = storage.s_bits.get_tensor(cute.make_layout(WINDOW_BLOCKS * _WORDS))
        s_warp = storage.s_warp.get_tensor(cute.make_layout(2 * _WARPS))
        K = block_indices.shape[3]
        tk = self.tile_keys(block_indices, heads, queries, tiles)
        r = tk.r0 + tidx
        row_live = r < S
        slots = self.load_slots(block_indices, tk, r, row_live)
        for w0 in cutlass.range(0, tk.nb_tile, WINDOW_BLOCKS, unroll=1):
            n_win = cutlass.min(WINDOW_BLOCKS, tk.nb_tile - w0)
            self.fill_window(slots, K, s_bits, r, row_live, w0, n_win)
            for jj in cutlass.range(tidx, n_win, self.threads, unroll=1):
                n = self.block_count(s_bits, jj)
                if n > 0:
                    counts[(tk.first_list + w0 + jj) * tiles + tk.column] = n
            cute.arch.sync_threads()  # the next window clears the bitmap
        _, dead = self.dead_prefix(s_warp, self.dead_slots(slots, K, r, row_live))
        if tidx == 0 and dead > 0:
            counts[tk.dead_key * tiles + tk.column] = dead

    # --- phase 2: positions ---------------------------------------------------------------------------------------

    @cute.kernel
    def kernel_scatter(self, block_indices, counts, ends, entry_query, entry_dest, lists, heads: cutlass.Int32,
                       queries: cutlass.Int32, tiles: cutlass.Int32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        S, K = block_indices.shape[2], block_indices.shape[3]
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_bits = storage.s_bits.get_tensor(cute.make_layout(WINDOW_BLOCKS * _WORDS))
        s_base = storage.s_base.get_tensor(cute.make_layout(WINDOW_BLOCKS))
        s_warp = storage.s_warp.get_tensor(cute.make_layout(2 * _WARPS))
        tk = self.tile_keys(block_indices, heads, queries, tiles)
        r = tk.r0 + tidx
        row_live = r < S
        local = r // self.block_size
        dest_row = ((tk.b * heads + tk.pc) * tk.length + r - tk.q_lo) * K  # the entry's row in its chunk's grid
        slots = self.load_slots(block_indices, tk, r, row_live)

        # Dead slots: after the rows below, in slot order.
        below, dead = self.dead_prefix(s_warp, self.dead_slots(slots, K, r, row_live))
        if row_live:
            ci = tk.dead_key * tiles + tk.column
            pos = ends[ci] - dead + below
            for k in cutlass.range_constexpr(self.max_k):
                if k < K:
                    j = slots[k]
                    if j < 0 or j > local:
                        entry_query[pos] = r
                        entry_dest[pos] = dest_row + k
                        pos += 1

        # Live slots: the list's entries of the tiles before (s_base), then of the rows below in this tile.
        warp = tidx // 32
        lower = cute.arch.lanemask_lt()
        for w0 in cutlass.range(0, tk.nb_tile, WINDOW_BLOCKS, unroll=1):
            n_win = cutlass.min(WINDOW_BLOCKS, tk.nb_tile - w0)
            self.fill_window(slots, K, s_bits, r, row_live, w0, n_win)
            for jj in cutlass.range(tidx, n_win, self.threads, unroll=1):
                n = self.block_count(s_bits, jj)
                if n > 0:  # the count kernel wrote this n: ends - n is the list's first position in the tile
                    s_base[jj] = ends[(tk.first_list + w0 + jj) * tiles + tk.column] - n
            cute.arch.sync_threads()
            if row_live:
                for k in cutlass.range_constexpr(self.max_k):
                    if k < K:
                        j = slots[k]
                        if j >= w0 and j < w0 + n_win and j <= local:
                            jj = j - w0
                            rank = cutlass.Int32(0)
                            for w in cutlass.range_constexpr(_WORDS):
                                word = s_bits[jj * _WORDS + w]
                                if w < warp:
                                    rank += cute.arch.popc(word)
                                if w == warp:
                                    rank += cute.arch.popc(word & cutlass.Int32(lower))
                            pos = s_base[jj] + rank
                            entry_query[pos] = r
                            entry_dest[pos] = dest_row + k
            cute.arch.sync_threads()

        # Each (b, p') chunk's first tile: its lists' starts and counts, relative to the chunk's first entry.
        if tk.column == 0:
            first = tk.kbase * tiles
            chunk_start = cutlass.Int64(ends[first] - counts[first])
            lists_before = (tk.b * heads + tk.pc) * tk.nb
            for j in cutlass.range(tidx, tk.nb, self.threads, unroll=1):
                ci = (tk.first_list + j) * tiles
                start = cutlass.Int64(ends[ci] - counts[ci])
                lists[tk.chunk, 0, lists_before + j] = start - chunk_start
                lists[tk.chunk, 1, lists_before + j] = cutlass.Int64(ends[ci + tiles - 1]) - start
            if tidx == 0 and tk.b == 0 and tk.pc == 0:  # the dead entries' start: the chunk's live count
                di = (tk.kbase + tk.bc * tk.nb) * tiles
                lists[tk.chunk, 0, tk.bc * tk.nb] = cutlass.Int64(ends[di] - counts[di]) - chunk_start


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    kernel = PlanLists(config)
    ps = params(config)
    fake = (*(fake_tensor(p) for p in ps if p.kind == "tensor"), cutlass.Int32(1), cutlass.Int32(1),
            cutlass.Int32(1), make_fake_stream())
    return compile_kernel(kernel, config, arch, fake, entry=getattr(kernel, config.phase))
