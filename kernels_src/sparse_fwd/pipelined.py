"""MSA sparse forward on wgmma: ping-pong warpgroups (pingpong.py) plus, inside each warpgroup, the next tile's QK
issued under this tile's PV and epilogue (sm90a only).

Per warpgroup and tile t (its own 64 rows, as in pingpong.py):
  1. wait for S(t) (issued during tile t - 1); mask, softmax, P converted to bf16 / f16 in registers;
  2. issue PV(t) with P from registers;
  3. wait for this thread's rows of tile t + 1, fence, warpgroup barrier (every warp's S(t) read is done, so
     tile t's buffer is free: the gather of tile t + 2 goes into it now);
  4. in turn with the other warpgroup (TURN barriers), issue S(t + 1) into the score accumulator, which P(t) has
     left (the converted copy feeds PV(t));
  5. wait for PV(t) only; the epilogue's stores of tile t run while S(t + 1) computes.
One named barrier per tile and warpgroup. Registers: S (64) + P (32) + O (64) per thread, no second S.
The turn accounting is pingpong.py's: one wait and one arrival per QK issue, warpgroup 1 arriving once before its
loop and warpgroup 0 waiting once after its loop.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from kernels_src.sparse_fwd.kernel import _LN2, _LOG2E
from kernels_src.sparse_fwd.pingpong import _BAR_ROWS, _BAR_TURN, _WG_THREADS, SparseAttentionPingPong
from kernels_src.tiles import WARPGROUP_ROWS


class SparseAttentionPipelined(SparseAttentionPingPong):
    @cute.jit
    def issue_qk_in_turn(self, tiled_mma, thr_mma, acc, s_q, s_k, tidx, wg):
        """S = Q K^T issued (not waited for) between this warpgroup's turn and the other's."""
        cute.arch.barrier(barrier_id=_BAR_TURN + wg, number_of_threads=2 * _WG_THREADS)
        self.qk(tiled_mma, thr_mma, acc, s_q, s_k, tidx, wait=False)
        cute.arch.barrier_arrive(barrier_id=_BAR_TURN + 1 - wg, number_of_threads=2 * _WG_THREADS)

    @cute.kernel
    def kernel_pingpong(
        self, q, k, v, entry_query, entry_dest, items, o_part, lse_part,
        scale: cutlass.Float32, hp: cutlass.Int32, hp_per_hk: cutlass.Int32,
        s_q_layout: cute.ComposedLayout, s_k_layout: cute.ComposedLayout,
        gcopy: cute.TiledCopy, gcopy_wg: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        n_entries = items[w, 3]
        if n_entries > 0:
            bp, j, start = items[w, 0], items[w, 1], items[w, 2]
            b = bp // hp
            p = bp - b * hp
            t0 = j * self.block_size
            seqlen = q.shape[1]
            wg = tidx // _WG_THREADS
            wg_tidx = tidx % _WG_THREADS
            row0 = wg * WARPGROUP_ROWS
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_q_all = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)
            s_k = storage.s_k.get_tensor(s_k_layout.outer, swizzle=s_k_layout.inner)
            s_v = storage.s_v.get_tensor(s_k_layout.outer, swizzle=s_k_layout.inner)
            s_vt = storage.s_v.get_tensor(cute.select(s_k_layout.outer, mode=[1, 0]), swizzle=s_k_layout.inner)

            self.load_block(gcopy, k[b, None, p // hp_per_hk, None], s_k, t0, seqlen, tidx, zero_tail=False)
            self.load_block(gcopy, v[b, None, p // hp_per_hk, None], s_v, t0, seqlen, tidx, zero_tail=True)

            tiled_mma, tiled_mma_pv = self._tiled_mma(), self._tiled_mma_pv()
            thr_mma = tiled_mma.get_slice(tidx)
            thr_pv = tiled_mma_pv.get_slice(tidx)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.block_size)), cutlass.Float32)
            acc_mn = self.rows_cols(acc)
            coord_mn = self.rows_cols(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.block_size))))
            acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.head_dim)), cutlass.Float32)
            acc_o_mn = self.rows_cols(acc_o)
            coord_o = self.rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim))))
            quad_lane = tidx % 4
            scale_log2 = scale * _LOG2E

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            # Prologue: the key block and tile 0 landed for the whole CTA, tile 1 on its way, S(0) issued.
            self.gather_rows(gcopy_wg, q, s_q_all, b, p, entry_query, start, n_entries, 0, row0, wg_tidx)
            cute.arch.cp_async_wait_group(0)
            self.publish_async_copies()
            cute.arch.sync_threads()
            if n_tiles > 1:
                self.gather_rows(gcopy_wg, q, s_q_all, b, p, entry_query, start, n_entries, 1, row0, wg_tidx)
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=_BAR_TURN, number_of_threads=2 * _WG_THREADS)
            self.issue_qk_in_turn(tiled_mma, thr_mma, acc, s_q_all[None, None, 0], s_k, tidx, wg)

            for tile in cutlass.range(n_tiles, unroll=1):
                e0 = start + tile * self.tile_queries
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                warpgroup.wait_group(0)  # S(t)

                lse_rows = cute.make_rmem_tensor((2,), cutlass.Float32)
                inv_l = cute.make_rmem_tensor((2,), cutlass.Float32)
                for r in cutlass.range_constexpr(2):
                    qi = coord_mn[r, 0][0] // self.group
                    i = self.row_query(entry_query, e0, qi, n_q, t0)
                    self.mask_row(acc_mn, coord_mn, r, i - t0)
                    row_max, row_sum = self.row_exp(acc_mn, r, scale_log2)
                    lse_rows[r] = (row_max * scale_log2 + cute.math.log2(row_sum, fastmath=True)) * _LN2
                    inv_l[r] = cute.arch.rcp_approx(row_sum)
                self.pv(tiled_mma_pv, thr_pv, acc, acc_o, s_vt, tidx, wait=False)

                if tile + 1 < n_tiles:
                    cute.arch.cp_async_wait_group(0)  # this thread's rows of tile t + 1
                    self.publish_async_copies()
                    # Every warp of this warpgroup has its rows of tile t + 1 in, and its S(t) read done.
                    cute.arch.barrier(barrier_id=_BAR_ROWS + wg, number_of_threads=_WG_THREADS)
                    if tile + 2 < n_tiles:
                        self.gather_rows(gcopy_wg, q, s_q_all, b, p, entry_query, start, n_entries, tile + 2, row0,
                                         wg_tidx)
                    self.issue_qk_in_turn(tiled_mma, thr_mma, acc, s_q_all[None, None, (tile + 1) % self.stages],
                                          s_k, tidx, wg)
                    warpgroup.wait_group(1)  # PV(t); S(t + 1) runs on under the epilogue
                else:
                    warpgroup.wait_group(0)

                for r in cutlass.range_constexpr(2):
                    row = coord_mn[r, 0][0]
                    qi = row // self.group
                    if qi < n_q:
                        dest = cutlass.Int64(entry_dest[e0 + qi])
                        g = row % self.group
                        if quad_lane == 0:
                            lse_part[dest, g] = lse_rows[r]
                        for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                            o_part[dest, g, coord_o[0, c][1]] = (acc_o_mn[r, c] * inv_l[r]).to(self.dtype)
            if wg == 0:  # warpgroup 1's last arrival on TURN + 0
                cute.arch.barrier(barrier_id=_BAR_TURN, number_of_threads=2 * _WG_THREADS)
