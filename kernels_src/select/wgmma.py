"""MSA selection on Hopper's warpgroup MMA (wgmma, sm90a only): the mma.sync kernel's CTA, TMA pipeline, row
ownership and heaps, with each key block's scores from one warpgroup's products, pipelined across blocks.

The 128-row tile is scored as two 64-row halves with accumulators of their own (64 fp32 per thread each, the
128 of one whole-tile accumulator), one wgmma group per half. While block j's two products run, the thread offers
block j - 1's score to its heap (the divergent, shared-memory-bound part), then reduces half 0 while half 1 still
runs; only half 1's reduction is left outside the products (the unpipelined kernel, 556 TFLOP/s at (b) 64K, left
all of it to the SM's second CTA: NOTES.md). Two CTAs per SM still fit (shared memory unchanged, 109 KB at
max_k 16).

Rows: a thread of a 64-row product holds rows r and r + 8; over the halves its rows are r, r + 8, r + 64, r + 72,
the whole-tile accumulator's (2, MMA_M) row order (kernels_src.tiles.wg_acc_rows_cols), so quad lanes 0 and 1 own
half 0's rows and lanes 2 and 3 half 1's, as in the kernel this one replaced.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from kernels_src import wgmma
from kernels_src.block_scores.wgmma import WarpgroupScores
from kernels_src.select.kernel import ProxySelect
from kernels_src.tiles import WARPGROUP_ROWS, wg_acc_rows_cols

_HALVES = 2  # 64-row products per 128-row tile


class ProxySelectWG(WarpgroupScores, ProxySelect):
    def __init__(self, config):
        super().__init__(config)
        if self.tile_m != _HALVES * WARPGROUP_ROWS:
            raise ValueError(f"{type(self).__name__}: tile_m {self.tile_m}; {_HALVES * WARPGROUP_ROWS} only")

    def score_tiles(self, storage, tma_atom_q, tma_q, tma_atom_k, tma_k, s_q_layout, s_k_layout, tiled_mma,
                    tidx, b, m_block, p, pk):
        """WarpgroupScores' handles plus, per half h, its accumulator, its (row, key) coordinates relative to
        the half and its Q rows [64 h, 64 h + 64)."""
        t = super().score_tiles(storage, tma_atom_q, tma_q, tma_atom_k, tma_k, s_q_layout, s_k_layout, tiled_mma,
                                tidx, b, m_block, p, pk)
        thr = self._wg_mma().get_slice(tidx)
        shape = (WARPGROUP_ROWS, self.block_size)
        t.half_acc = [cute.make_rmem_tensor(thr.partition_shape_C(shape), cutlass.Float32) for _ in range(_HALVES)]
        t.half_acc_mn = [wg_acc_rows_cols(a) for a in t.half_acc]
        t.half_coord_mn = wg_acc_rows_cols(thr.partition_C(cute.make_identity_tensor(shape)))
        t.half_q = [cute.local_tile(t.s_q, (WARPGROUP_ROWS, self.head_dim), (h, 0)) for h in range(_HALVES)]
        return t

    @cute.jit
    def issue_half(self, t, j, h: cutlass.Constexpr):
        """Half h of block j's scores, S_h = Q_h K_j^T, issued as one wgmma group (not waited for). The caller has
        waited for K stage j % stages to be full. The MMA object is made here: its accumulate flag is state set
        per step, which must not outlive this call."""
        wgmma.issue_smem(self._wg_mma(), t.tidx, t.half_acc[h], t.half_q[h], t.s_k[None, None, j % self.stages])

    @cute.jit
    def half_row_maxes(self, t, h: cutlass.Constexpr, j, pos0, first_masked):
        """Block j's max over its causal keys of each of half h's two rows of this thread's quad (quad
        butterfly: every lane of the quad holds both). pos0: the key position of the tile's first row."""
        acc_mn = t.half_acc_mn[h]
        if j >= first_masked:
            self.mask_causal(acc_mn, t.half_coord_mn, pos0 + h * WARPGROUP_ROWS, j * self.block_size)
        maxes = []
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row_max = acc_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
            row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
            maxes.append(cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=1)))
        return maxes

    @cute.jit
    def scan_blocks(self, t, tiled_mma, warp_idx, n_blocks, pos0, first_masked, quad_lane, scale, k_scale, b, pk,
                    heap, worst_score):
        """Per block j: both halves issued; block j - 1's score offered to the heap while they run; half 0
        reduced while half 1 runs; then half 1. Every product is waited for in the step that issued it: ptxas
        serialises wgmma whose group is still pending across the loop's back edge (C7514)."""
        score = -cutlass.Float32.inf  # block j - 1's score of the owned row (none before block 0)
        for j in cutlass.range(n_blocks, unroll=1):
            kb = self.key_block_scale(k_scale, b, j, pk)  # loaded ahead of the products it scales
            stage = j % self.stages
            cute.arch.mbarrier_wait(t.k_full + stage, (j // self.stages) % 2)
            for h in cutlass.range_constexpr(_HALVES):
                self.issue_half(t, j, h)
            if j > 0:
                worst_score = self.offer(heap, score, j - 1, worst_score)

            warpgroup.wait_group(1)
            maxes = self.half_row_maxes(t, 0, j, pos0, first_masked)
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warp is past its reads of K stage j: warp 0 refills it
            if warp_idx == 0:
                if j + self.stages < n_blocks:
                    self.load_k_block(t.tma_atom_k, t.t_k_g, t.t_k_s, t.k_full, t.k_bytes, j + self.stages, stage)
            maxes += self.half_row_maxes(t, 1, j, pos0, first_masked)

            score = -cutlass.Float32.inf
            for r in cutlass.range_constexpr(len(maxes)):
                if quad_lane == r:
                    score = self.scaled(maxes[r], scale, kb)
        self.offer(heap, score, n_blocks - 1, worst_score)


class ProxySelectWGPairs(ProxySelectWG):
    """Two key blocks per loop step (fp8 selection: its products take half of bf16's time, so the reductions the
    one-block step leaves outside them weigh twice as much). Block j + 1's half 0 is issued once block j's half 0
    is reduced (its accumulator is free), and its half 1 once block j's half 1 is: so block j's second reduction and
    its heap offer run under block j + 1's products, and per two blocks only the last half's reduction is left
    outside them. Every group is still waited for in the step that issued it (C7514). Blocks j and j + 1 are in
    two of the four K stages while the next pair's are loading; both stages are refilled at the end of the step.
    An odd last block takes the one-block step."""

    def __init__(self, config):
        super().__init__(config)
        if self.stages < 4 or self.stages % 2:
            raise ValueError(f"{type(self).__name__}: stages {self.stages}; an even number >= 4 (two pairs)")

    @cute.jit
    def owned(self, maxes, quad_lane, scale, kb):
        """The owned row's scaled score of one block from its quad's row maxima."""
        score = -cutlass.Float32.inf
        for r in cutlass.range_constexpr(len(maxes)):
            if quad_lane == r:
                score = self.scaled(maxes[r], scale, kb)
        return score

    @cute.jit
    def refill(self, t, warp_idx, j, n_blocks):
        """Warp 0 loads block j + stages into block j's stage (every warp is past its reads of it)."""
        if warp_idx == 0:
            if j + self.stages < n_blocks:
                self.load_k_block(t.tma_atom_k, t.t_k_g, t.t_k_s, t.k_full, t.k_bytes, j + self.stages,
                                  j % self.stages)

    @cute.jit
    def wait_k(self, t, j):
        cute.arch.mbarrier_wait(t.k_full + j % self.stages, (j // self.stages) % 2)

    @cute.jit
    def scan_blocks(self, t, tiled_mma, warp_idx, n_blocks, pos0, first_masked, quad_lane, scale, k_scale, b, pk,
                    heap, worst_score):
        score = -cutlass.Float32.inf  # the previous block's score of the owned row (none before block 0)
        for jp in cutlass.range(n_blocks // 2, unroll=1):
            j = 2 * jp
            kb0 = self.key_block_scale(k_scale, b, j, pk)  # loaded ahead of the products they scale
            kb1 = self.key_block_scale(k_scale, b, j + 1, pk)
            self.wait_k(t, j)
            for h in cutlass.range_constexpr(_HALVES):
                self.issue_half(t, j, h)
            if j > 0:
                worst_score = self.offer(heap, score, j - 1, worst_score)

            warpgroup.wait_group(1)  # block j, half 0
            maxes = self.half_row_maxes(t, 0, j, pos0, first_masked)
            self.wait_k(t, j + 1)
            self.issue_half(t, j + 1, 0)
            warpgroup.wait_group(1)  # block j, half 1 (block j + 1's half 0 still running)
            maxes += self.half_row_maxes(t, 1, j, pos0, first_masked)
            self.issue_half(t, j + 1, 1)
            worst_score = self.offer(heap, self.owned(maxes, quad_lane, scale, kb0), j, worst_score)

            warpgroup.wait_group(1)  # block j + 1, half 0
            maxes1 = self.half_row_maxes(t, 0, j + 1, pos0, first_masked)
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warp is past its reads of blocks j and j + 1: refill both stages
            self.refill(t, warp_idx, j, n_blocks)
            self.refill(t, warp_idx, j + 1, n_blocks)
            maxes1 += self.half_row_maxes(t, 1, j + 1, pos0, first_masked)
            score = self.owned(maxes1, quad_lane, scale, kb1)

        if n_blocks % 2 == 1:  # the odd last block, one-block step
            j = n_blocks - 1
            kb = self.key_block_scale(k_scale, b, j, pk)
            self.wait_k(t, j)
            for h in cutlass.range_constexpr(_HALVES):
                self.issue_half(t, j, h)
            if j > 0:
                worst_score = self.offer(heap, score, j - 1, worst_score)
            warpgroup.wait_group(1)
            maxes = self.half_row_maxes(t, 0, j, pos0, first_masked)
            warpgroup.wait_group(0)
            maxes += self.half_row_maxes(t, 1, j, pos0, first_masked)
            score = self.owned(maxes, quad_lane, scale, kb)
        self.offer(heap, score, n_blocks - 1, worst_score)


def _tree_max(acc_mn, r, lo: int, hi: int):
    """max of row r's columns [lo, hi) as a tree (depth log2, not a chain of dependent maxima), NaN-propagating as
    the one-block loop's row reduction is (max.NaN: a NaN score ranks alike in both schedules); plain Python at
    trace time, so its loops unroll."""
    vals = [acc_mn[r, c] for c in range(lo, hi)]
    while len(vals) > 1:
        vals = [cute.arch.fmax(vals[i], vals[i + 1], nan=True) if i + 1 < len(vals) else vals[i]
                for i in range(0, len(vals), 2)]
    return vals[0]


class ProxySelectWGWide(ProxySelectWG):
    """Blocks of 64 scored two per loop step (schedule "wide"): a step loads 128 keys, blocks 2 js and 2 js + 1, and
    scores them as the one-block loop scores a block of 128 (two m64n128 groups, one per 64-row half, half 0
    reduced while half 1 runs, the previous step's offers under both). A row's two block maxima come from the two
    column halves of its accumulator: a thread's columns are (pair, n8 tile) with the pair fastest, column
    8 tile + 2 (lane % 4) + pair, so its first half (tiles 0-7) holds keys 0-63. Per key this halves the steps
    (stage wait, CTA barrier, refill, wgmma issue and wait) and doubles the products' width; the reductions,
    butterflies and heap offers per block stay. Shared memory: two stages of 128 keys (the block-of-128 kernel's)."""

    BLOCKS_PER_STEP = 2

    def __init__(self, config):
        super().__init__(config)
        if config.block_size * self.BLOCKS_PER_STEP != 128:
            raise ValueError(f"{type(self).__name__}: block_size {config.block_size}; 64 only (steps of 128 keys)")
        self.block_size = config.block_size * self.BLOCKS_PER_STEP  # a step's keys: TMA boxes, stages, products

    def load_steps(self, n_blocks):
        return (n_blocks + 1) // self.BLOCKS_PER_STEP

    @cute.jit
    def half_pair_maxes(self, t, h: cutlass.Constexpr, js, pos0, first_masked_step):
        """Step js's two block maxima over their causal keys for each of half h's two rows of this thread's quad,
        [(block 2 js, block 2 js + 1), ...] (quad butterflies: every lane of the quad holds them)."""
        acc_mn = t.half_acc_mn[h]
        if js >= first_masked_step:
            self.mask_causal(acc_mn, t.half_coord_mn, pos0 + h * WARPGROUP_ROWS, js * self.block_size)
        n_cols = cute.size(acc_mn, mode=[1])
        maxes = []
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            pair = []
            for part in cutlass.range_constexpr(self.BLOCKS_PER_STEP):
                m = _tree_max(acc_mn, r, part * n_cols // 2, (part + 1) * n_cols // 2)
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))
                pair.append(cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1)))
            maxes.append(pair)
        return maxes

    @cute.jit
    def scan_blocks(self, t, tiled_mma, warp_idx, n_blocks, pos0, first_masked, quad_lane, scale, k_scale, b, pk,
                    heap, worst_score):
        """Per step js: both halves issued; step js - 1's two scores offered (ascending) while they run; half 0
        reduced while half 1 runs; then half 1. A last block 2 js + 1 = n_blocks past the keys is offered with a
        score of -inf beyond every row's first forced block, so it never enters."""
        n_steps = self.load_steps(n_blocks)
        first_masked_step = first_masked // self.BLOCKS_PER_STEP  # steps below it hold no key past the first row
        score0 = -cutlass.Float32.inf  # step js - 1's scores of the owned row (none before step 0)
        score1 = -cutlass.Float32.inf
        for js in cutlass.range(n_steps, unroll=1):
            j = self.BLOCKS_PER_STEP * js
            kb0 = self.key_block_scale(k_scale, b, j, pk)  # loaded ahead of the products they scale
            kb1 = self.key_block_scale(k_scale, b, cutlass.min(j + 1, n_blocks - 1), pk)  # k_scale has NB rows
            stage = js % self.stages
            cute.arch.mbarrier_wait(t.k_full + stage, (js // self.stages) % 2)
            for h in cutlass.range_constexpr(2):
                self.issue_half(t, js, h)
            if js > 0:
                worst_score = self.offer(heap, score0, j - 2, worst_score)
                worst_score = self.offer(heap, score1, j - 1, worst_score)

            warpgroup.wait_group(1)
            maxes = self.half_pair_maxes(t, 0, js, pos0, first_masked_step)
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warp is past its reads of K stage js: warp 0 refills it
            if warp_idx == 0:
                if js + self.stages < n_steps:
                    self.load_k_block(t.tma_atom_k, t.t_k_g, t.t_k_s, t.k_full, t.k_bytes, js + self.stages, stage)
            maxes += self.half_pair_maxes(t, 1, js, pos0, first_masked_step)

            score0 = -cutlass.Float32.inf
            score1 = -cutlass.Float32.inf
            for r in cutlass.range_constexpr(len(maxes)):
                if quad_lane == r:
                    score0 = self.scaled(maxes[r][0], scale, kb0)
                    score1 = self.scaled(maxes[r][1], scale, kb1)
        last = self.BLOCKS_PER_STEP * n_steps - 2
        worst_score = self.offer(heap, score0, last, worst_score)
        self.offer(heap, score1, last + 1, worst_score)
