"""MSA sparse forward on Hopper's warpgroup MMA (wgmma, sm90a only): the mma.sync kernel's work items, gathers and
softmax, with both products issued by warpgroups.

Two warpgroups x 64 rows of the 128-row tile:
  - S = Q K^T: wgmma m64n128k16, both operands read from shared memory by descriptors (the q tile and the key block
    are already in the K-major 128B-swizzled layout wgmma reads: tiles.smem_tile), 8 steps over D;
  - O = P V: wgmma m64n128k16 with P from registers (the QK accumulator converted to bf16/f16 in place: for a
    k16 step, two adjacent n8 accumulator tiles hold exactly the A fragment's values) and V^T from shared memory,
    whose transposed view of the K-major key block is wgmma's MN-major 128B-swizzled layout.
No ldmatrix and one instruction per 64 x 128 x 16 step instead of 64 mma.sync: the mma.sync kernel issues on a
quarter of its cycles and is latency-bound (kernels_src/sparse_fwd/NOTES.md). cp.async writes reach wgmma through
a generic -> async proxy fence before the barrier. Blackwell has no wgmma: sm100a keeps the mma.sync kernel.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from kernels_src.sparse_fwd.kernel import SparseAttention
from kernels_src.tiles import WARPGROUP_ROWS, wg_acc_as_a, wg_acc_rows_cols

class SparseAttentionWG(SparseAttention):
    def __init__(self, config):
        super().__init__(config)
        if self.tile_m != 2 * WARPGROUP_ROWS or self.threads != 256:
            raise ValueError(f"sparse_fwd wgmma: tile_m {self.tile_m}, threads {self.threads}; 128 and 256 only")

    def _tiled_mma(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, cutlass.Float32,
            (self.tile_m // WARPGROUP_ROWS, 1, 1), (WARPGROUP_ROWS, self.block_size))

    def _tiled_mma_pv(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, cutlass.Float32,
            (self.tile_m // WARPGROUP_ROWS, 1, 1), (WARPGROUP_ROWS, self.head_dim),
            a_source=warpgroup.OperandSource.RMEM)

    def rows_cols(self, t: cute.Tensor) -> cute.Tensor:
        return wg_acc_rows_cols(t)

    @cute.jit
    def publish_async_copies(self):
        """This thread's cp.async writes (q tile, key block) become visible to wgmma's async-proxy reads once the
        barrier that follows has been passed by every thread."""
        cute.arch.fence_view_async_shared()

    @cute.jit
    def qk(self, tiled_mma, thr_mma, acc, s_a, s_b, tidx, prefetch: cutlass.Constexpr = True,
           wait: cutlass.Constexpr = True):
        """acc = A B^T over the tile (fp32, unscaled): wgmma on shared-memory descriptors, waited for unless
        wait=False (then the caller waits: warpgroup.wait_group). The MMA object is made here: its accumulate
        flag is set per step, and state set inside the caller's loop must not outlive the loop body."""
        tiled_mma = self._tiled_mma()
        thr_mma = tiled_mma.get_slice(tidx)
        t_ra = thr_mma.make_fragment_A(thr_mma.partition_A(s_a))
        t_rb = thr_mma.make_fragment_B(thr_mma.partition_B(s_b))
        warpgroup.fence()
        for kk in cutlass.range_constexpr(cute.size(t_ra, mode=[2])):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
            cute.gemm(tiled_mma, acc, t_ra[None, None, kk], t_rb[None, None, kk], acc)
        warpgroup.commit_group()
        if cutlass.const_expr(wait):
            warpgroup.wait_group(0)

    @cute.jit
    def pv(self, tiled_mma, thr_mma, acc_p, acc_o, s_vt, tidx):
        """acc_o = P V: P from the score accumulator's registers (converted to bf16/f16), V^T by descriptor."""
        tiled_mma = self._tiled_mma_pv()
        thr_mma = tiled_mma.get_slice(tidx)
        r_p = cute.make_rmem_tensor_like(acc_p, self.dtype)
        r_p.store(acc_p.load().to(self.dtype))
        t_rp = cute.make_tensor(r_p.iterator, wg_acc_as_a(r_p.layout))
        t_rv = thr_mma.make_fragment_B(thr_mma.partition_B(s_vt))
        warpgroup.fence()
        for kk in cutlass.range_constexpr(cute.size(t_rv, mode=[2])):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, kk != 0)
            cute.gemm(tiled_mma, acc_o, t_rp[None, None, kk], t_rv[None, None, kk], acc_o)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
