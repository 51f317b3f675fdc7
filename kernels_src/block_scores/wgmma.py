"""The proxy score tiles on Hopper's warpgroup MMA (wgmma, sm90a only), for block_scores and select.

The CTA's 128 threads are one warpgroup: S = Q K_j^T for the 128-row tile is two m64 x Bs x 16 wgmma steps per
16 of Dp (the tiled MMA iterates M), both operands read by descriptor from the TMA-written 128B-swizzled tiles.
The mma.sync kernels feed their products through ldmatrix from the same tiles and issue 16x8x16 steps, which
caps them near 440 TFLOP/s (kernels_src/select/NOTES.md); here one instruction covers 64 x Bs x 16 and the
operands never pass through registers. The accumulator (128 fp32 per thread) gives each thread four rows, so
the consumers' quad butterflies and "lane q of a quad takes the quad's row q" carry over unchanged; rows are
taken from the MMA's own partition (coord_mn). Blackwell has no wgmma: sm100a keeps the mma.sync kernels.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from kernels_src import wgmma
from kernels_src.block_scores.kernel import ProxyBlockScores
from kernels_src.tiles import WARPGROUP_ROWS, wg_acc_rows_cols

_K = cute.nvgpu.OperandMajorMode.K


class WarpgroupScores:
    """Mixin over ProxyBlockScores and its subclasses: the score tiles of one warpgroup's wgmma."""

    def __init__(self, config):
        super().__init__(config)
        if self.threads != 128:
            raise ValueError(f"{type(self).__name__}: threads {self.threads}; 128 only (one warpgroup)")

    def _wg_mma(self):
        """One warpgroup's m64 x Bs atom; over the tile_m-row tile it iterates M (tile_m / 64 steps)."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, _K, _K, cutlass.Float32, (1, 1, 1),
                                                 (WARPGROUP_ROWS, self.block_size))

    def score_mma(self):
        """None: the products are issued by _wg_mma, made where they are issued (a TiledMma carried into the kernel
        would carry its per-step accumulate flag as kernel parameters)."""
        return None

    def score_tiles(self, storage, tma_atom_q, tma_q, tma_atom_k, tma_k, s_q_layout, s_k_layout, tiled_mma,
                    tidx, b, m_block, p, pk):
        """The mma.sync kernel's TMA handles (partitions, barriers) with the accumulator, its coordinates and the
        operand tiles of the warpgroup MMA."""
        t = self.tma_tiles(storage, tma_atom_q, tma_q, tma_atom_k, tma_k, s_q_layout, s_k_layout, b, m_block, p, pk)
        thr = self._wg_mma().get_slice(tidx)
        shape = (self.tile_m, self.block_size)
        t.acc = cute.make_rmem_tensor(thr.partition_shape_C(shape), cutlass.Float32)
        t.acc_mn = wg_acc_rows_cols(t.acc)
        t.coord_mn = wg_acc_rows_cols(thr.partition_C(cute.make_identity_tensor(shape)))
        t.s_q = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)  # (tile_m, Dp)
        t.s_k = storage.s_k.get_tensor(s_k_layout.outer, swizzle=s_k_layout.inner)  # (Bs, Dp, stages)
        t.tidx = tidx
        return t

    @cute.jit
    def score_block(self, t, tiled_mma, warp_idx, j, n_blocks):
        """acc = Q K_j^T (unscaled fp32) by wgmma, waited for; then, as the mma.sync kernel's, every thread is past
        its reads of K stage j % stages and warp 0 refills that stage with block j + stages. The MMA object is made
        here: its accumulate flag is state set per step, which must not outlive this call."""
        stage = j % self.stages
        cute.arch.mbarrier_wait(t.k_full + stage, (j // self.stages) % 2)

        wgmma.issue_smem(self._wg_mma(), t.tidx, t.acc, t.s_q, t.s_k[None, None, stage])
        warpgroup.wait_group(0)

        cute.arch.sync_threads()
        if warp_idx == 0:
            if j + self.stages < n_blocks:
                self.load_k_block(t.tma_atom_k, t.t_k_g, t.t_k_s, t.k_full, t.k_bytes, j + self.stages, stage)


class ProxyBlockScoresWG(WarpgroupScores, ProxyBlockScores):
    """block_scores on wgmma: the row maxima are stored as the mma.sync kernel stores them."""
