"""The reverse index's counting sort (CuTeDSL): kernels_src/plan_lists/__init__.py says what and why.

One CTA per `threads` query rows of one (b, p): 128 (one tile) or, for the scatter, 512 (four tiles); thread t on
row r = r0 + t. A tile is 128 rows: the (key, tile) count matrices have one column per tile. Shared memory holds
the CTA's bitmap of one window of blocks, word-major: word w (= the row's warp, rows w * 32 .. w * 32 + 31) of
block j at s_bits[w * window + j - w0], bit r % 32, set when row r chose block j (a live slot: 0 <= j <= r // Bs).
Word-major, the lanes of a warp that look up different blocks hit different banks.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.plan_lists import TILE_ROWS, window_blocks

_TILE_WARPS = TILE_ROWS // 32  # warps (bitmap words) per tile


@cute.jit
def exclusive_scan(s_warp, d, warps: cutlass.Constexpr, segment: cutlass.Constexpr):
    """(the sum of d over the threads below this one, the sum over all threads) within this thread's segment of
    `segment` warps, in a CTA of `warps` warps: a warp scan by shuffles, then the warps' totals through s_warp
    (warps words). Two barriers: the second lets the next scan reuse s_warp."""
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
    seg0 = warp // segment * segment
    for w in cutlass.range_constexpr(warps):
        v = s_warp[w]
        if w >= seg0 and w < seg0 + segment:
            total += v
            if w < warp:
                below += v
    cute.arch.sync_threads()
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
        self.warps = config.threads // 32  # = bitmap words per block
        self.tiles_per_cta = config.threads // TILE_ROWS
        self.window = window_blocks(config)
        self.stage = 2 * config.threads * config.max_k  # scatter: (position, row << 8 | slot) per window entry
        self.traced = {"smem_bytes": 0}

    def _storage(self):
        W, win, warps = self.warps, self.window, self.warps
        slots_words = self.threads * (self.max_k + 1)  # the rows' slots, padded: conflict-free row reads
        if self.phase == "count":
            @cute.struct
            class SharedStorage:
                s_bits: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, W * win], 16]
                s_stage: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, slots_words], 16]
                s_warp: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, warps], 16]
        else:
            @cute.struct
            class SharedStorage:
                s_bits: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, W * win], 16]
                s_wpre: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, W * win], 16]
                s_gbase: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.tiles_per_cta * win], 16]
                s_bstart: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, win], 16]
                s_stage: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.stage], 16]
                s_drow: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.threads], 16]
                s_warp: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, warps], 16]

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        return SharedStorage

    def _launch(self, block_indices, stream):
        B, Hp, S, _ = block_indices.shape
        return dict(grid=(B * Hp * cute.ceil_div(S, self.threads), 1, 1), block=(self.threads, 1, 1),
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
        """This thread's tile (of the CTA's tiles_per_cta): (b, p), the chunk (head group hg = p // c, query chunk
        qc) and its key bases.

        Keys, chunk-major: chunk (hg, qc) holds B c (NB_c + 1) keys, its lists (b, p', j) for j < NB_c =
        ceil(q_hi / Bs), then one dead key per (b, p'). Every query chunk but the last holds Q queries, so the
        keys before a chunk are closed forms: sum over qc' < qc of B c (NB(qc') + 1), NB(qc') = (qc' + 1) Q / Bs.
        flash_msa_rt.ops.sparse_plan.chunk_keys is the host's statement of the same sizes."""
        cta, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        B, Hp, S, _ = block_indices.shape
        Bs = self.block_size
        per_bp = cute.ceil_div(S, self.threads)
        bp = cta // per_bp
        t = (cta - bp * per_bp) * self.tiles_per_cta + tidx // TILE_ROWS
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
        cta_r0 = r0 - (tidx // TILE_ROWS) * TILE_ROWS
        return TileKeys(b=b, p=p, pc=pc, r0=r0, q_lo=q_lo, length=q_hi - q_lo, nb=nb, kbase=kbase,
                        first_list=kbase + (b * heads + pc) * nb, dead_key=kbase + bc * nb + b * heads + pc,
                        column=t - q_lo // TILE_ROWS, chunk=hg * n_q + qc, bc=bc, cta_r0=cta_r0,
                        nb_cta=(cutlass.min(cta_r0 + self.threads, S) - 1) // Bs + 1)

    @cute.jit
    def load_slots(self, block_indices, tk, row_live, s_in):
        """This thread's row's K slots in registers (max_k of them, -1 past K and for rows past S): the CTA's rows
        copied to shared memory first (consecutive threads on consecutive slots of a row: coalesced), where one
        load per (row, slot) would read each row's 32-byte sectors once per slot."""
        tidx, _, _ = cute.arch.thread_idx()
        S, K = block_indices.shape[2], block_indices.shape[3]
        pad = self.max_k + 1
        # Every load first, unpredicated (indices clamped into the tensor), then the stores: a load inside the
        # store's branch made each store wait for its own load in turn.
        vals = cute.make_rmem_tensor(self.max_k, cutlass.Int32)
        for i in cutlass.range_constexpr(self.max_k):
            e = cutlass.min(tidx + i * self.threads, self.threads * K - 1)
            row = e // K
            r = cutlass.min(tk.cta_r0 + row, S - 1)
            vals[i] = block_indices[tk.b, tk.p, r, e - row * K]
        for i in cutlass.range_constexpr(self.max_k):
            e = tidx + i * self.threads
            row = e // K
            if i < K and tk.cta_r0 + row < S:
                s_in[row * pad + e - row * K] = vals[i]
        cute.arch.sync_threads()
        slots = cute.make_rmem_tensor(self.max_k, cutlass.Int32)
        for k in cutlass.range_constexpr(self.max_k):
            v = cutlass.Int32(-1)
            if row_live and k < K:
                v = s_in[tidx * pad + k]
            slots[k] = v
        cute.arch.sync_threads()  # s_in's words are reused
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
    def fill_window(self, slots, K, s_bits, r, w0, n_win):
        """The window's bitmap: cleared, then one bit per (row, live slot) with w0 <= j < w0 + n_win. A warp's rows
        share their own block (Bs >= 32): each slot's bits of it are set by one ballot and one atomic, where up to
        32 lanes' atomics on that one word would serialise."""
        tidx, _, _ = cute.arch.thread_idx()
        for w in cutlass.range(tidx, self.warps * self.window, self.threads, unroll=1):
            s_bits[w] = cutlass.Int32(0)
        cute.arch.sync_threads()
        lane = tidx % 32
        row_word = (tidx // 32) * self.window - w0
        local = r // self.block_size  # rows past S hold no live slot (slots -1)
        bit = cutlass.Int32(1) << lane
        for k in cutlass.range_constexpr(self.max_k):
            j = slots[k]  # -1 past K
            own = cutlass.Int32(0)
            other = cutlass.Int32(0)
            if j >= w0 and j < w0 + n_win:
                if j == local:
                    own = cutlass.Int32(1)
                if j >= 0 and j < local:
                    other = cutlass.Int32(1)
            mask = cute.arch.vote_ballot_sync(own != 0)
            if lane == 0 and mask != 0:
                cute.arch.atomic_or(s_bits.iterator + (row_word + local), mask)
            if other != 0:
                cute.arch.atomic_or(s_bits.iterator + (row_word + j), bit)
        cute.arch.sync_threads()

    @cute.jit
    def block_count(self, s_bits, jj, w_lo: cutlass.Constexpr, w_hi: cutlass.Constexpr):
        """Rows of words w_lo .. w_hi - 1 (warps) that chose window block jj."""
        n = cutlass.Int32(0)
        for w in cutlass.range_constexpr(w_lo, w_hi):
            n += cute.arch.popc(s_bits[w * self.window + jj])
        return n

    # --- phase 1: counts -----------------------------------------------------------------------------------------

    @cute.kernel
    def kernel_count(self, block_indices, counts, heads: cutlass.Int32, queries: cutlass.Int32,
                     tiles: cutlass.Int32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        S = block_indices.shape[2]
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_bits = storage.s_bits.get_tensor(cute.make_layout(self.warps * self.window))
        s_in = storage.s_stage.get_tensor(cute.make_layout(self.threads * (self.max_k + 1)))
        s_warp = storage.s_warp.get_tensor(cute.make_layout(self.warps))
        K = block_indices.shape[3]
        tk = self.tile_keys(block_indices, heads, queries, tiles)
        r = tk.cta_r0 + tidx
        row_live = r < S
        slots = self.load_slots(block_indices, tk, row_live, s_in)
        for w0 in cutlass.range(0, tk.nb_cta, self.window, unroll=1):
            n_win = cutlass.min(self.window, tk.nb_cta - w0)
            self.fill_window(slots, K, s_bits, r, w0, n_win)
            for jj in cutlass.range(tidx, n_win, self.threads, unroll=1):
                n = self.block_count(s_bits, jj, 0, self.warps)
                if n > 0:
                    counts[(tk.first_list + w0 + jj) * tiles + tk.column] = n
            cute.arch.sync_threads()  # the next window clears the bitmap
        _, dead = exclusive_scan(s_warp, self.dead_slots(slots, K, r, row_live), self.warps, self.warps)
        if tidx == 0 and dead > 0:
            counts[tk.dead_key * tiles + tk.column] = dead

    # --- phase 2: positions ---------------------------------------------------------------------------------------

    @cute.kernel
    def kernel_scatter(self, block_indices, counts, ends, entry_query, entry_dest, lists, heads: cutlass.Int32,
                       queries: cutlass.Int32, tiles: cutlass.Int32, SharedStorage: cutlass.Constexpr):
        """Each window's entries are ranked into shared memory in list order first (block, then row), each with its
        global position; then consecutive threads store consecutive entries. A list's entries from the CTA's rows
        are consecutive in global memory (its rows are consecutive queries), so the stores go out in runs (~16
        entries per list at 512 rows, S = 64K, K = 16), where storing from each row's slots scattered every
        4-byte store to its own sector."""
        tidx, _, _ = cute.arch.thread_idx()
        S, K = block_indices.shape[2], block_indices.shape[3]
        win = self.window
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_bits = storage.s_bits.get_tensor(cute.make_layout(self.warps * win))
        s_wpre = storage.s_wpre.get_tensor(cute.make_layout(self.warps * win))
        s_gbase = storage.s_gbase.get_tensor(cute.make_layout(self.tiles_per_cta * win))
        s_bstart = storage.s_bstart.get_tensor(cute.make_layout(win))
        s_stage = storage.s_stage.get_tensor(cute.make_layout(self.stage))
        s_warp = storage.s_warp.get_tensor(cute.make_layout(self.warps))
        s_drow = storage.s_drow.get_tensor(cute.make_layout(self.threads))
        tk = self.tile_keys(block_indices, heads, queries, tiles)
        r = tk.cta_r0 + tidx
        row_live = r < S
        local = r // self.block_size
        dest_row = ((tk.b * heads + tk.pc) * tk.length + r - tk.q_lo) * K  # the entry's row in its chunk's grid
        s_drow[tidx] = dest_row  # for the stores of the row's entries by other threads
        slots = self.load_slots(block_indices, tk, row_live, s_stage)

        # Dead slots: after the tile's rows below, in slot order.
        below, dead = exclusive_scan(s_warp, self.dead_slots(slots, K, r, row_live), self.warps, _TILE_WARPS)
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

        warp = tidx // 32
        tile = tidx // TILE_ROWS
        lower = cutlass.Int32(cute.arch.lanemask_lt())
        for w0 in cutlass.range(0, tk.nb_cta, win, unroll=1):
            n_win = cutlass.min(win, tk.nb_cta - w0)
            self.fill_window(slots, K, s_bits, r, w0, n_win)
            # Per block: rows of the words below each word (s_wpre), and its count in the CTA (s_bstart, for now).
            for jj in cutlass.range(tidx, n_win, self.threads, unroll=1):
                run = cutlass.Int32(0)
                for w in cutlass.range_constexpr(self.warps):
                    s_wpre[w * win + jj] = run
                    run += cute.arch.popc(s_bits[w * win + jj])
                s_bstart[jj] = run
            cute.arch.sync_threads()
            # Per (tile, block): the global position of the block's first entry in the tile, less the CTA's rows
            # of the block before the tile (so that position = s_gbase + the rows below in the CTA), by the tile's
            # threads from its (key, tile) cell. The count kernel wrote n there; ends - n is the list's first
            # position in the tile.
            # The cells' loads are unpredicated (clamped into the matrix), so each thread's are issued together.
            cells = ends.shape[0]
            for i in cutlass.range_constexpr(win // TILE_ROWS):
                jj = tidx % TILE_ROWS + i * TILE_ROWS
                end = ends[cutlass.min((tk.first_list + w0 + jj) * tiles + tk.column, cells - 1)]
                if jj < n_win:
                    lo = s_wpre[tile * _TILE_WARPS * win + jj]
                    hi = s_bstart[jj]
                    if tile < self.tiles_per_cta - 1:
                        hi = s_wpre[(tile + 1) * _TILE_WARPS * win + jj]
                    if hi > lo:
                        s_gbase[tile * win + jj] = end - (hi - lo) - lo
            # s_bstart: counts -> the blocks' first positions in the CTA's list order (consecutive blocks per
            # thread, then a CTA scan of the threads' sums).
            per = cute.ceil_div(n_win, self.threads)
            j_lo = cutlass.min(tidx * per, n_win)
            j_hi = cutlass.min(j_lo + per, n_win)
            mine = cutlass.Int32(0)
            for jj in cutlass.range(j_lo, j_hi, unroll=1):
                mine += s_bstart[jj]
            start, total = exclusive_scan(s_warp, mine, self.warps, self.warps)
            for jj in cutlass.range(j_lo, j_hi, unroll=1):
                n = s_bstart[jj]
                s_bstart[jj] = start
                start += n
            cute.arch.sync_threads()
            if row_live:
                for k in cutlass.range_constexpr(self.max_k):
                    if k < K:
                        j = slots[k]
                        if j >= w0 and j < w0 + n_win and j <= local:
                            jj = j - w0
                            rank = s_wpre[warp * win + jj] + cute.arch.popc(s_bits[warp * win + jj] & lower)
                            at = s_bstart[jj] + rank
                            s_stage[at] = s_gbase[tile * win + jj] + rank
                            s_stage[self.stage // 2 + at] = (tidx << 8) | k
            cute.arch.sync_threads()
            for e in cutlass.range(tidx, total, self.threads, unroll=1):
                pos = s_stage[e]
                v = s_stage[self.stage // 2 + e]
                entry_query[pos] = tk.cta_r0 + (v >> 8)
                entry_dest[pos] = s_drow[v >> 8] + (v & 255)
            cute.arch.sync_threads()  # the next window clears the bitmap and reuses the stage

        # Each (b, p') chunk's first tile: its lists' starts and counts, relative to the chunk's first entry.
        if tk.column == 0 and tk.r0 < S:
            first = tk.kbase * tiles
            chunk_start = cutlass.Int64(ends[first] - counts[first])
            lists_before = (tk.b * heads + tk.pc) * tk.nb
            for j in cutlass.range(tidx % TILE_ROWS, tk.nb, TILE_ROWS, unroll=1):
                ci = (tk.first_list + j) * tiles
                start = cutlass.Int64(ends[ci] - counts[ci])
                lists[tk.chunk, 0, lists_before + j] = start - chunk_start
                lists[tk.chunk, 1, lists_before + j] = cutlass.Int64(ends[ci + tiles - 1]) - start
            if tidx % TILE_ROWS == 0 and tk.b == 0 and tk.pc == 0:  # the dead entries' start: the live count
                di = (tk.kbase + tk.bc * tk.nb) * tiles
                lists[tk.chunk, 0, tk.bc * tk.nb] = cutlass.Int64(ends[di] - counts[di]) - chunk_start
