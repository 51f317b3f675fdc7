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

The epilogue writes O_slot in 8-byte pieces: in the accumulator a quad of lanes holds one row, each lane a column
pair of every n8 tile, so a 4-byte store per n8 tile writes half a 32-byte sector of each of 8 rows per warp
instruction. One shuffle per pair of n8 tiles between lanes q and q ^ 1 gives each lane two adjacent column pairs:
half the store instructions, each filling its rows' sectors (store_row). A 4 x 4 transpose for 16-byte stores
spilled at the 128 registers of two CTAs per SM (NOTES.md).
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from kernels_src import wgmma
from kernels_src.sparse_fwd.kernel import SparseAttention
from kernels_src.packed import pack_pair, store_global_v2
from kernels_src.tiles import WARPGROUP_ROWS, wg_acc_as_a, wg_acc_rows_cols

class SparseAttentionWG(SparseAttention):
    def __init__(self, config):
        super().__init__(config)
        if self.tile_m != 2 * WARPGROUP_ROWS or self.threads != 256:
            raise ValueError(f"sparse_fwd wgmma: tile_m {self.tile_m}, threads {self.threads}; 128 and 256 only")

    def o_pieces(self) -> int:
        """The whole O at once (the wgmma kernels build at D 256 without spilling)."""
        return 1

    def _tiled_mma(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, cutlass.Float32,
            (self.tile_m // WARPGROUP_ROWS, 1, 1), (WARPGROUP_ROWS, self.block_size))

    def _tiled_mma_pv(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, cutlass.Float32,
            (self.tile_m // WARPGROUP_ROWS, 1, 1), (WARPGROUP_ROWS, self.head_dim),
            a_source=warpgroup.OperandSource.RMEM)

    def rows_cols(self, t: cute.Tensor) -> cute.Tensor:
        return wg_acc_rows_cols(t)

    @cute.jit
    def store_row(self, acc_o_mn, coord_o, r, row, dest, lse_rows, inv_l, o_part, lse_part, quad_lane):
        """Row r of the tile (tile row `row`) at partial row `dest` (Int64), 8 bytes per store. The four lanes of
        a quad call it together (one row): its shuffles are among them only, so quads of rows past the tile's
        queries may skip it, as they skip the base kernel's.

        Lane q of a quad holds word k (a bf16/f16 pair) of n8 tile k at columns 8 k + 2 q, +1
        (wgmma_check.epilogue_mismatches). For n8 tiles 2m and 2m + 1, lanes q and q ^ 1 swap a word so that
        lane q holds tile 2m + (q & 1)'s columns of lanes q & 2 and (q & 2) + 1: 4 adjacent columns, stored at
        8 (2m + (q & 1)) + 4 (q >> 1); the quad writes the 32 bytes of columns 16m .. 16m + 15 at once."""
        g = row % self.group
        n_vals = cute.size(acc_o_mn, mode=[1])
        lo = (quad_lane & 1) != 0
        quad = cutlass.Int32(0xF) << (cute.arch.lane_idx() & 28)  # the shuffles' member mask: this quad
        # The row packed first (word k: n8 tile k, this lane's column pair): half the registers of its fp32 values.
        words = [pack_pair(acc_o_mn[r, 2 * k] * inv_l[r], acc_o_mn[r, 2 * k + 1] * inv_l[r], self.dtype)
                 for k in range(n_vals // 2)]
        for m in cutlass.range_constexpr(n_vals // 4):  # n8 tiles 2m, 2m + 1: lane q keeps tile 2m + lo's word
            keep = cutlass.select_(lo, words[2 * m + 1], words[2 * m])
            got = cute.arch.shuffle_sync_bfly(cutlass.select_(lo, words[2 * m], words[2 * m + 1]), offset=1,
                                              mask=quad)  # tile 2m + lo's word of lane q ^ 1
            # columns 8 (2m + lo) + 4 hi .. + 3 (lanes 2 hi, 2 hi + 1): 8 bytes
            store_global_v2(o_part[dest, g, None].iterator.toint() + (2 * m + (quad_lane & 1)) * 16
                            + (quad_lane & 2) * 4, cutlass.select_(lo, got, keep), cutlass.select_(lo, keep, got))
        if quad_lane == 0:
            lse_part[dest, g] = lse_rows[r]

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
        wgmma.issue_smem(self._tiled_mma(), tidx, acc, s_a, s_b)
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
        wgmma.issue(tiled_mma, acc_o, t_rp, t_rv)
        warpgroup.wait_group(0)
