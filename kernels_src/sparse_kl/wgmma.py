"""MSA KL pass on Hopper's warpgroup MMA (wgmma, sm90a only): the mma.sync kernel's tiles, heads loop and (A, T, L)
shares, with the score products S_g = Q_g K^T and S_p = Q_p K_p^T issued by warpgroups.

Each tile is 64 distinct queries x this CTA's 64 keys: warpgroup w computes the queries against keys
[32 w, 32 w + 32) with wgmma m64n32k16, both operands by descriptor (tiles.smem_tile's K-major 128B-swizzled
tiles), 8 steps over D. A thread then holds 2 query rows x 8 keys of its warpgroup's 32, so a key group of the
KL shares is still one warpgroup's keys (kl_part columns: group = 2 * key slice + tidx // 128, as before).
cp.async writes reach wgmma through a generic -> async proxy fence before the barrier. Blackwell has no wgmma.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from kernels_src.sparse_fwd.wgmma import WARPGROUP_ROWS, wg_acc_rows_cols
from kernels_src.sparse_kl.kernel import SparseKL


class SparseKLWG(SparseKL):
    def __init__(self, config):
        super().__init__(config)
        if self.tile_m != WARPGROUP_ROWS or self.tile_n != 64 or self.threads != 256:
            raise ValueError(f"sparse_kl wgmma: tile_m {self.tile_m}, tile_n {self.tile_n}, threads "
                             f"{self.threads}; 64, 64 and 256 only (two warpgroups x 32 keys)")

    def _score_mma(self):
        warpgroups = self.threads // 128
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, cutlass.Float32,
            (1, warpgroups, 1), (WARPGROUP_ROWS, self.tile_n // warpgroups))

    def rows_cols(self, t: cute.Tensor) -> cute.Tensor:
        return wg_acc_rows_cols(t)

    @cute.jit
    def publish_async_copies(self):
        cute.arch.fence_view_async_shared()

    @cute.jit
    def gemm(self, tiled_mma, thr_mma, acc, s_a, s_b, tidx, trans_a: cutlass.Constexpr, trans_b: cutlass.Constexpr,
             accumulate: cutlass.Constexpr = False):
        """acc = A B^T (both K-major smem tiles): wgmma by descriptor, waited for. The MMA object is made here:
        its accumulate flag is set per step, and state set inside the caller's loop must not outlive it."""
        if cutlass.const_expr(trans_a or trans_b or accumulate):
            raise NotImplementedError("sparse_kl wgmma: A B^T of K-major tiles into a fresh accumulator only")
        tiled_mma = self._score_mma()
        thr_mma = tiled_mma.get_slice(tidx)
        t_ra = thr_mma.make_fragment_A(thr_mma.partition_A(s_a))
        t_rb = thr_mma.make_fragment_B(thr_mma.partition_B(s_b))
        warpgroup.fence()
        for kk in cutlass.range_constexpr(cute.size(t_ra, mode=[2])):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
            cute.gemm(tiled_mma, acc, t_ra[None, None, kk], t_rb[None, None, kk], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
