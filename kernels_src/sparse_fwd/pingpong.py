"""MSA sparse forward on wgmma with the two warpgroups in ping-pong (sm90a only).

The lockstep wgmma kernel (wgmma.py) runs both warpgroups through every phase of a tile together: a CTA barrier,
both QK products, both softmaxes, both PV products, both epilogues, a CTA barrier. While the two softmaxes and
epilogues run the tensor pipe idles, and while the products run the ALUs and MUFU idle (Nsight Compute: the
tensor pipe 27 % busy at one CTA per SM, kernels_src/sparse_fwd/NOTES.md).

Here each warpgroup owns its 64 rows of every tile from gather to epilogue:
  - it gathers its own rows into its half of the q tile buffers (a 128-thread cp.async copy) and waits on its own
    named barrier, so the two warpgroups no longer meet once per tile (only once per item, after the key block's
    load, which both warpgroups' threads share);
  - its QK product is issued in turn with the other warpgroup's (FA3's "warp scheduler barrier"): warpgroup w
    waits on barrier TURN + w, issues, then arrives on the other's, warpgroup 0 first. The turns only order the
    issues; what lets one warpgroup's softmax and epilogue run under the other's products is that nothing else
    makes the two wait for each other (the warmup KL pass, whose warpgroups share every key tile, gained 2 %
    from turns alone: kernels_src/warmup_kl/NOTES.md).
With `stages = 1` (what the runtime runs at G >= 2) each warpgroup has one buffer, refilled as soon as its QK product
is done, so the next tile's rows arrive under this tile's softmax, PV product and epilogue; the 96 KB of shared
memory and 128 registers let two CTAs share an SM (NOTES.md, "one q buffer"). With two buffers the next tile is
gathered a whole tile ahead.
Barrier accounting (each completes at 256 threads: 128 waiting + 128 arriving): warpgroup 1 arrives on TURN + 0
once before its loop and once per tile (n + 1 times); warpgroup 0 waits there once per tile and once after its
loop (n + 1); warpgroup 0 arrives on TURN + 1 once per tile, where warpgroup 1 waits once per tile. No barrier is
left with a pending arrival when the CTA exits.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from kernels_src.barriers import SparseFwdPingPong as Bar
from kernels_src.constants import LOG2E, WARPGROUP_THREADS
from kernels_src.sparse_fwd.wgmma import SparseAttentionWG
from kernels_src.tiles import WARPGROUP_ROWS, copy_row, cp_async_rows, warpgroup_of
from kernels_src.work_items import keys_in_query_rows


class SparseAttentionPingPong(SparseAttentionWG):
    # Measured against loading each plan entry where it is used with 16 threads per gathered row (NOTES.md, one
    # 16K-query chunk at S = 64K): 8 threads per row, and at G <= 4 the tile's mask queries and destinations
    # loaded at its top (their latency was a fifth of the warp stalls, exposed after the PV product):
    # (b) 4.19 -> 3.90 ms, (a) 2.13 -> 2.00; at G = 16 the early loads cost 6 % and 8 threads alone gain 5 %.
    ROW_THREADS = 8

    def __init__(self, config):
        super().__init__(config)
        # With one q buffer at G >= 8, loading the entries where they are used leaves ptxas short of registers at
        # the 128 two CTAs per SM allow, and it serialises every wgmma (C7512; the build refuses it); loaded at
        # the tile's top they fit, and measured 1.02x at G = 16 (6.93 -> 6.82 ms).
        self.entries_ahead = self.group <= 4 or self.stages == 1

    def occupancy(self) -> dict:
        """One q buffer (96 KB of shared memory): two CTAs per SM, so ptxas must keep to 128 registers (the build
        refuses a spill). The carveout is given so that the compile does not query a device for it."""
        if self.stages == 1:
            return dict(min_blocks_per_mp=2, preferred_smem_carveout=100)
        return {}

    @cute.kernel
    def kernel_forward(
        self, q, k, v, entry_query, entry_dest, items, o_part, lse_part,
        scale: cutlass.Float32, hp: cutlass.Int32, hp_per_hk: cutlass.Int32,
        s_q_layout: cute.ComposedLayout, s_k_layout: cute.ComposedLayout,
        gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        """The lockstep kernel's launch (SparseAttention.forward) and arguments; gcopy loads the key block with all
        256 threads, a 128-thread copy of the same atoms gathers a warpgroup's rows."""
        gcopy_wg = cp_async_rows(self.dtype, self.head_dim, WARPGROUP_THREADS, self.ROW_THREADS)
        tidx, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        n_entries = items[w, 3]
        if n_entries > 0:
            b, p, start, t0 = self.item_block(items, w, hp)
            seqlen, q_t0 = keys_in_query_rows(t0, q, k)
            wg, wg_tidx = warpgroup_of(tidx)
            row0 = wg * WARPGROUP_ROWS  # this warpgroup's first row of every tile
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_q_all, s_k, s_v, s_vt = self.smem_views(storage, s_q_layout, s_k_layout)
            self.load_block(gcopy, k[b, None, p // hp_per_hk, None], s_k, t0, seqlen, tidx, zero_tail=False)
            self.load_block(gcopy, v[b, None, p // hp_per_hk, None], s_v, t0, seqlen, tidx, zero_tail=True)
            tiled_mma, tiled_mma_pv, thr_mma, thr_pv, acc, acc_mn, coord_mn, acc_o, acc_o_mn, coord_o = \
                self.accumulators(tidx)
            quad_lane = tidx % 4
            scale_log2 = scale * LOG2E

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            gthr = gcopy_wg.get_slice(wg_tidx)
            g_rows = cute.size(gthr.partition_S(cute.make_identity_tensor((WARPGROUP_ROWS, self.head_dim))),
                               mode=[1])
            g_query = cute.make_rmem_tensor((g_rows,), cutlass.Int32)
            key_limit = cute.make_rmem_tensor((2,), cutlass.Int32)
            dest = cute.make_rmem_tensor((2,), cutlass.Int32)
            # Group 0: the key block (both warpgroups' threads) and this warpgroup's rows of tile 0.
            self.gather_queries(entry_query, start, n_entries, 0, row0, gthr, g_query)
            self.gather_rows(gcopy_wg, q, s_q_all, b, p, g_query, 0, row0, gthr)
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=Bar.TURN, number_of_threads=2 * WARPGROUP_THREADS)
            for tile in cutlass.range(n_tiles, unroll=1):
                e0 = start + tile * self.tile_queries
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                s_q = s_q_all[None, None, tile % self.stages]
                if cutlass.const_expr(self.entries_ahead):
                    self.row_entries(entry_query, entry_dest, e0, n_q, q_t0, coord_mn, key_limit, dest)
                if cutlass.const_expr(self.stages == 1):
                    cute.arch.cp_async_wait_group(0)  # this tile's rows, gathered under the last tile's math
                else:
                    if tile + 1 < n_tiles:
                        self.gather_queries(entry_query, start, n_entries, tile + 1, row0, gthr, g_query)
                        self.gather_rows(gcopy_wg, q, s_q_all, b, p, g_query, tile + 1, row0, gthr)
                    else:
                        cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(1)
                self.publish_async_copies()
                if tile == 0:
                    cute.arch.sync_threads()  # the key block came from both warpgroups' threads
                else:
                    cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)

                cute.arch.barrier(barrier_id=Bar.TURN + wg, number_of_threads=2 * WARPGROUP_THREADS)
                self.qk(tiled_mma, thr_mma, acc, s_q, s_k, tidx, wait=False)
                cute.arch.barrier_arrive(barrier_id=Bar.TURN + 1 - wg, number_of_threads=2 * WARPGROUP_THREADS)
                warpgroup.wait_group(0)
                if cutlass.const_expr(self.stages == 1):
                    # One buffer: once every warp's QK has read it, the next tile's rows go into it and arrive
                    # under this tile's softmax, PV product and epilogue.
                    cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)
                    if tile + 1 < n_tiles:
                        self.gather_queries(entry_query, start, n_entries, tile + 1, row0, gthr, g_query)
                        self.gather_rows(gcopy_wg, q, s_q_all, b, p, g_query, tile + 1, row0, gthr)

                lse_rows = cute.make_rmem_tensor((2,), cutlass.Float32)
                inv_l = cute.make_rmem_tensor((2,), cutlass.Float32)
                if cutlass.const_expr(self.entries_ahead):
                    for r in cutlass.range_constexpr(2):
                        self.softmax_row(acc_mn, coord_mn, r, key_limit[r], scale_log2, lse_rows, inv_l)
                else:
                    self.tile_softmax(acc_mn, coord_mn, entry_query, e0, n_q, q_t0, scale_log2, lse_rows, inv_l)
                self.pv(tiled_mma_pv, thr_pv, acc, acc_o, s_vt, tidx)

                if cutlass.const_expr(self.entries_ahead):
                    for r in cutlass.range_constexpr(2):
                        if dest[r] >= 0:
                            self.store_row(acc_o_mn, coord_o, r, coord_mn[r, 0][0], cutlass.Int64(dest[r]), lse_rows,
                                           inv_l, o_part, lse_part, quad_lane)
                else:
                    self.store_tile(acc_o_mn, coord_mn, coord_o, lse_rows, inv_l, entry_dest, o_part, lse_part, e0,
                                    n_q, quad_lane)
                if cutlass.const_expr(self.stages == 2):
                    # This warpgroup's warps are past their reads of the buffer before its gather of tile + 2.
                    cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)
            if wg == 0:  # warpgroup 1's last arrival on TURN + 0 (see the module docstring)
                cute.arch.barrier(barrier_id=Bar.TURN, number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def row_entries(self, entry_query, entry_dest, e0, n_q, t0, coord_mn, key_limit, dest):
        """This thread's two score rows of the tile: key_limit = i - t0 (the causal mask; past the tile's queries a
        limit that masks nothing, the row is never stored) and the entry's partial row (-1 past the queries)."""
        for r in cutlass.range_constexpr(2):
            qi = coord_mn[r, 0][0] // self.group
            key_limit[r] = self.block_size
            dest[r] = -1
            if qi < n_q:
                key_limit[r] = entry_query[e0 + qi] - t0
                dest[r] = entry_dest[e0 + qi]

    @cute.jit
    def gather_queries(self, entry_query, start, n_entries, tile, row0, gthr, g_query):
        """The queries of this thread's gather rows of `tile` (-1 past the tile's queries), all loaded before
        gather_rows issues their copies."""
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        t_c = gthr.partition_S(cute.make_identity_tensor((WARPGROUP_ROWS, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(g_query)):
            qi = (row0 + t_c[0, m, 0][0]) // self.group
            g_query[m] = -1
            if qi < n_q:
                g_query[m] = entry_query[start + tile * self.tile_queries + qi]

    @cute.jit
    def gather_rows(self, gcopy_wg, q, s_q_all, b, p, g_query, tile, row0, gthr):
        """cp.async, as one group, this warpgroup's 64 rows [row0, row0 + 64) of `tile` into buffer tile % stages:
        tile row r <- q[b, i, p*G + r % G], i from gather_queries. Rows past the tile's queries are left as they
        are (never stored)."""
        s_rows = cute.local_tile(s_q_all[None, None, tile % self.stages], (WARPGROUP_ROWS, self.head_dim),
                                 (row0 // WARPGROUP_ROWS, 0))
        head_base = p * self.group
        t_s = gthr.partition_D(s_rows)
        t_c = gthr.partition_S(cute.make_identity_tensor((WARPGROUP_ROWS, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
            row = row0 + t_c[0, m, 0][0]
            if g_query[m] >= 0:
                copy_row(gcopy_wg, self.dtype, q[b, g_query[m], head_base + row % self.group, None], t_s, t_c, m)
        cute.arch.cp_async_commit_group()
