"""MSA selection kernel (CuTeDSL): block_scores' score tiles, reduced to a running top-K per query row.

Per CTA: one (query tile of 128 rows, proxy head p, batch b), the same TMA + mma.sync pipeline as block_scores.
After each key block j the four lanes of a quad hold the maxima of the same four rows; lane q owns row q of them,
so each of the 128 threads owns exactly one query row i and keeps, for it:
  - K - L slots (score, block) in shared memory, slot-major ([slot][row]) so a warp's rows hit distinct banks,
    ordered as a binary heap with the worst kept entry at the root (L = local_blocks, a runtime scalar);
  - in a register, the root's score (the threshold).
A candidate block j < blk(i) - L + 1 enters only if its score beats the threshold strictly: blocks arrive in
ascending order, so an equal later block loses the tie (the contract gives ties to the smaller index). It replaces
the root, the worst entry (lowest score, and among equal lowest the larger block index), and sifts down: O(log K)
per insert, where a linear rescan cost O(K) and made K = 64 four times slower than K = 16 (NOTES.md). The forced
blocks F(i) = {max(0, blk(i) - L + 1), ..., blk(i)} are never candidates; they are written after the kept blocks
(all smaller), ascending, then -1 for empty slots: the reference's sorted row (flash_msa_rt.reference.selection).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.block_scores.kernel import ProxyBlockScores
from kernels_src.select import Config
from kernels_src.tiles import tile_storage


@dataclasses.dataclass
class RowHeap:
    """Trace-time handles of the owned row's heap: its slots, row, slot count and local block."""

    slot_score: object
    slot_block: object
    row: object
    n_slots: object
    first_forced: object  # blk(i) - L + 1, the first forced block (may be negative): candidates lie below it


class ProxySelect(ProxyBlockScores):
    def __init__(self, config: Config):
        super().__init__(config)
        self.max_k = config.max_k
        # The selection's key block (the blocks ranked, forced and written); block_size is the block a loop step
        # loads and scores, the same block except where a subclass scores several per step (wgmma.py, "wide").
        self.select_block = config.block_size

    @cute.jit
    def __call__(
        self,
        q_proxy: cute.Tensor,  # (B, S, Hp, Dp)
        k_proxy: cute.Tensor,  # (B, S, Hpk, Dp)
        block_indices: cute.Tensor,  # (B, Hp, S, K) int32
        k_scale: Optional[cute.Tensor],  # (B, NB, Hpk) f32, fp8 variants only: each key block's scale
        scale: cutlass.Float32,
        group: cutlass.Int32,  # Hp // Hpk
        local_blocks: cutlass.Int32,  # L: the forced blocks per row, blk(i) - L + 1 .. blk(i)
        stream: cuda.CUstream,
    ):
        s_q_layout, s_k_layout, tma_atom_q, tma_q, tma_atom_k, tma_k, tiled_mma = self.host_setup(q_proxy, k_proxy)
        slots = self.max_k * self.tile_m

        @cute.struct
        class SharedStorage:
            q_full: cute.struct.MemRange[cutlass.Int64, 1]
            k_full: cute.struct.MemRange[cutlass.Int64, self.stages]
            slot_score: cute.struct.MemRange[cutlass.Float32, slots]
            slot_block: cute.struct.MemRange[cutlass.Int16, slots]
            s_q: tile_storage(self.dtype, s_q_layout)
            s_k: tile_storage(self.dtype, s_k_layout)

        smem_bytes = SharedStorage.size_in_bytes()
        self.traced["smem_bytes"] = smem_bytes

        self.kernel(
            q_proxy, k_proxy, block_indices, k_scale, scale, group, local_blocks,
            tma_atom_q, tma_q, tma_atom_k, tma_k,
            s_q_layout, s_k_layout, tiled_mma, SharedStorage,
        ).launch(
            grid=(cute.ceil_div(q_proxy.shape[1], self.tile_m), q_proxy.shape[2], q_proxy.shape[0]),
            block=(self.threads, 1, 1),
            smem=smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        q_proxy: cute.Tensor,
        k_proxy: cute.Tensor,
        block_indices: cute.Tensor,
        k_scale: Optional[cute.Tensor],
        scale: cutlass.Float32,
        group: cutlass.Int32,
        local_blocks: cutlass.Int32,
        tma_atom_q: cute.CopyAtom,
        tma_q: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        tma_k: cute.Tensor,
        s_q_layout: cute.ComposedLayout,
        s_k_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile_rev, p, b = cute.arch.block_idx()
        n_tiles, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        m_block = n_tiles - 1 - tile_rev  # longest causal tiles first
        m0 = m_block * self.tile_m
        seqlen = q_proxy.shape[1]
        # Query row i sits at key position query_offset + i (bottom-right alignment: the queries are the last
        # seqlen of k_proxy's positions); every causal bound below is in key positions, from pos0 = row m0's.
        query_offset = k_proxy.shape[1] - seqlen
        pos0 = m0 + query_offset
        rows_valid = cutlass.min(self.tile_m, seqlen - m0)
        n_blocks = cute.ceil_div(pos0 + rows_valid, self.select_block)
        first_masked = (pos0 + 1) // self.select_block
        top_k = block_indices.shape[3]
        # L clamped to [1, min(K, max_k)] (the op checks 1 <= L <= K <= max_k): the L forced blocks take the last
        # places, so no write ever leaves the row
        n_places = cutlass.min(top_k, self.max_k)
        n_forced = cutlass.max(cutlass.min(local_blocks, n_places), 1)
        n_slots = n_places - n_forced

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        slot_score = storage.slot_score.get_tensor(cute.make_layout((self.max_k, self.tile_m), stride=(self.tile_m, 1)))
        slot_block = storage.slot_block.get_tensor(cute.make_layout((self.max_k, self.tile_m), stride=(self.tile_m, 1)))
        t = self.score_tiles(storage, tma_atom_q, tma_q, tma_atom_k, tma_k, s_q_layout, s_k_layout, tiled_mma,
                             tidx, b, m_block, p, p // group)

        # The row this thread owns: row r == its lane in the quad, of the four rows the quad holds.
        quad_lane = tidx % 4
        row = t.coord_mn[0, 0][0]
        for r in cutlass.range_constexpr(1, cute.size(t.acc_mn, mode=[0])):
            if quad_lane == r:
                row = t.coord_mn[r, 0][0]
        i = m0 + row
        local_block = (pos0 + row) // self.select_block
        first_forced = local_block - n_forced + 1  # negative near the sequence start: every block is forced

        # Empty slots score -inf with block -1: any real (finite) score beats them.
        for s in cutlass.range(n_slots, unroll=1):
            slot_score[s, row] = -cutlass.Float32.inf
            slot_block[s, row] = cutlass.Int16(-1)
        worst_score = -cutlass.Float32.inf  # the heap root's score: a block must beat it to enter
        if n_slots <= 0:
            worst_score = cutlass.Float32.inf  # K = L: only the forced blocks, no candidate ever enters

        heap = RowHeap(slot_score=slot_score, slot_block=slot_block, row=row, n_slots=n_slots,
                       first_forced=first_forced)
        self.start_loads(t, tidx, warp_idx, self.load_steps(n_blocks))
        self.scan_blocks(t, tiled_mma, warp_idx, n_blocks, pos0, first_masked, quad_lane, scale, k_scale, b,
                         p // group, heap, worst_score)

        if i < seqlen:
            self.write_selection(block_indices, slot_block, b, p, i, row, local_block, first_forced, n_slots, top_k)

    def load_steps(self, n_blocks):
        """Loop steps, each loading one K stage, for n_blocks selection blocks (trace time): one per block here."""
        return n_blocks

    @cute.jit
    def scan_blocks(self, t, tiled_mma, warp_idx, n_blocks, pos0, first_masked, quad_lane, scale, k_scale, b, pk,
                    heap, worst_score):
        """Every key block the tile's rows can see, in ascending order, offered to the owned row's heap. pos0: the
        key position of the tile's first row."""
        for j in cutlass.range(n_blocks, unroll=1):
            score = self.owned_block_max(t, tiled_mma, warp_idx, j, n_blocks, pos0, first_masked, quad_lane)
            worst_score = self.offer(heap, self.scaled(score, scale, self.key_block_scale(k_scale, b, j, pk)), j,
                                     worst_score)

    @cute.jit
    def key_block_scale(self, k_scale: Optional[cute.Tensor], b, j, pk):
        """fp8 variants: key block j's scale k_scale[b, j, pk]; None otherwise."""
        kb = None
        if cutlass.const_expr(k_scale is not None):
            kb = k_scale[b, j, pk]
        return kb

    @cute.jit
    def scaled(self, score, scale, kb):
        """A block's score as the reference ranks it: scale first (the reference's ties), then, in fp8 variants,
        the key block's scale kb. kb is a power of two (flash_msa_rt.reference.fp8), so the product is exact and
        ranks as the reference's scale * s_q(i) * s_k(j) * <q8, k8> (s_q(i), a power of two common to the row,
        changes no comparison within it, so the kernel never reads it)."""
        out = score * scale
        if cutlass.const_expr(kb is not None):
            out = out * kb
        return out

    @cute.jit
    def offer(self, heap, score, j, worst_score):
        """Block j enters the row's heap if it is a candidate (below the first forced block) and beats the
        threshold strictly (ascending blocks: an equal later block loses the tie); returns the threshold."""
        if j < heap.first_forced and score > worst_score:
            worst_score = self.heap_replace_worst(heap.slot_score, heap.slot_block, heap.row, heap.n_slots, score, j)
        return worst_score

    @cute.jit
    def owned_block_max(self, t, tiled_mma, warp_idx, j, n_blocks, pos0, first_masked, quad_lane) -> cutlass.Float32:
        """The unscaled score of key block j for the row this thread owns (max over its causal keys; pos0 is the
        key position of the tile's first row)."""
        self.score_block(t, tiled_mma, warp_idx, j, n_blocks)
        if j >= first_masked:
            self.mask_causal(t.acc_mn, t.coord_mn, pos0, j * self.block_size)
        return self.owned_row_max(t.acc_mn, quad_lane)

    @cute.jit
    def owned_row_max(self, acc_mn: cute.Tensor, quad_lane) -> cutlass.Float32:
        """Max over the block's keys of each of the quad's four rows (quad butterfly), keeping the owned one."""
        mine = -cutlass.Float32.inf
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row_max = acc_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
            row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
            row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=1))
            if quad_lane == r:
                mine = row_max
        return mine

    @cute.jit
    def heap_replace_worst(self, slot_score, slot_block, row, n_slots, score, block):
        """Replace the root of the row's heap (its worst entry) with (score, block) and sift it down; returns the
        new root's score, the next threshold. "Worse" is the contract's order reversed: lower score, and among
        equal scores the larger block index (it loses ties). O(log K) shared-memory accesses per insert."""
        pos = cutlass.Int32(0)
        child = cutlass.Int32(1)
        while child < n_slots:
            c = child
            c_score = slot_score[c, row]
            c_block = cutlass.Int32(slot_block[c, row])
            if c + 1 < n_slots:
                r_score = slot_score[c + 1, row]
                r_block = cutlass.Int32(slot_block[c + 1, row])
                if r_score < c_score or (r_score == c_score and r_block > c_block):
                    c = c + 1
                    c_score = r_score
                    c_block = r_block
            if c_score < score or (c_score == score and c_block > block):
                slot_score[pos, row] = c_score  # the worse child moves up
                slot_block[pos, row] = cutlass.Int16(c_block)
                pos = c
                child = 2 * c + 1
            else:
                child = n_slots  # heap order holds: stop
        slot_score[pos, row] = score
        slot_block[pos, row] = cutlass.Int16(block)
        return slot_score[0, row]

    @cute.jit
    def write_selection(self, block_indices, slot_block, b, p, i, row, local_block, first_forced, n_slots, top_k):
        """Kept blocks in ascending order (each placed at its rank), then the forced blocks max(0, first_forced)
        .. local_block ascending (every kept block is below them), then -1: the reference's ascending row."""
        n_kept = cutlass.Int32(0)
        for s in cutlass.range(n_slots, unroll=1):
            bl = cutlass.Int32(slot_block[s, row])
            if bl >= 0:
                n_kept += 1
                rank = cutlass.Int32(0)
                for s2 in cutlass.range(n_slots, unroll=1):
                    other = cutlass.Int32(slot_block[s2, row])
                    if other >= 0 and other < bl:
                        rank += 1
                block_indices[b, p, i, rank] = bl
        lo = cutlass.max(first_forced, 0)
        for f in cutlass.range(lo, local_block + 1, unroll=1):
            block_indices[b, p, i, n_kept + f - lo] = f
        for s in cutlass.range(n_kept + local_block + 1 - lo, top_k, unroll=1):
            block_indices[b, p, i, s] = -1
