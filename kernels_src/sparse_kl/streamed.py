"""MSA KL pass in ping-pong with the heads streamed (sm90a only, G = 8 and 16, where the G + 1 head tiles of a
tile do not fit beside each other: kernels_src/sparse_kl/pingpong.py holds them at G <= 4).

As in pingpong.py, warpgroup w takes tiles w, w + 2, ... of the item, all 128 keys of each (m64n128), and the two
meet only once per item. A tile is G + 1 steps, one product each: the G main heads S_n = Q_n K^T (tau += exp2(S_n
- lse_n)), then the proxy S_p = Q_p K_p^T and the (A, T, L) epilogue. Each warpgroup streams its steps through a
ring of `stages` 16 KB row buffers: step u's rows (and the 64 rows' lse of its head, one cp.async word per row,
into a small table beside the ring) are gathered stages - 1 steps ahead, one commit group per step, so a step
waits on its own group only (wait_group(stages - 2)) and then on its warpgroup's named barrier, which also tells
every warp that the previous step's product is complete and its buffer free for the next gather. The gathering
threads keep their rows' queries in registers from the tile's first step. mma.sync (the shipped kernel at G >= 8
before this one) steps the heads with both warpgroups in lockstep on 64-key slices, two CTAs per block.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.barriers import SparseKLPingPong as Bar
from kernels_src.constants import LOG2E, WARPGROUP_THREADS
from kernels_src.sparse_kl.pingpong import SparseKLPingPong
from kernels_src.tiles import copy_row, copy_word, cp_async_rows, cp_async_word, row_table, tile_storage, warpgroup_of
from kernels_src.work_items import keys_in_query_rows


class SparseKLStreamed(SparseKLPingPong):
    # Gather rows: 4 threads each, so that a thread's per-step copies are 2 rows, not 8 (the gathers were half of
    # the warp samples: (c) 64K chunk 4.57 -> 3.39 ms at 8 threads per row, 2.98 at 4).
    ROW_THREADS = 4

    def _check_schedule(self):
        if self.resident or self.tile_n != self.block_size or self.stages < 2:
            raise ValueError(f"sparse_kl streamed ping-pong: G >= 8 on the whole block, a ring of >= 2 stages; got "
                             f"G {self.group}, tile_n {self.tile_n}, stages {self.stages}")

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, q_proxy: cute.Tensor, k_proxy: cute.Tensor,
                 entry_query: cute.Tensor, entry_dest: cute.Tensor, items: cute.Tensor, lse: cute.Tensor,
                 kl_part: cute.Tensor, scale: cutlass.Float32, proxy_scale: cutlass.Float32,
                 hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32, stream: cuda.CUstream):
        l_kv = self._smem_layout((self.tile_n, self.head_dim))
        # ring buffer w * stages + s: warpgroup w's rows of the step in slot s; the lse table likewise
        l_rows = self._smem_layout((self.tile_m, self.head_dim, 2 * self.stages))
        l_lse = row_table(self.tile_m, 2 * self.stages, 1)

        @cute.struct
        class SharedStorage:
            s_k: tile_storage(self.dtype, l_kv)
            s_kp: tile_storage(self.dtype, l_kv)
            s_q: tile_storage(self.dtype, l_rows)
            s_lse: tile_storage(cutlass.Float32, l_lse)

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_streamed(q, k, q_proxy, k_proxy, entry_query, entry_dest, items, lse, kl_part, scale,
                             proxy_scale, hp_per_hk, hp_per_hpk, l_kv, l_rows, l_lse, self._gmem_copy(),
                             SharedStorage).launch(
            grid=(items.shape[0], 1, 1), block=(self.threads, 1, 1), smem=self.traced["smem_bytes"], stream=stream)

    @cute.kernel
    def kernel_streamed(self, q, k, q_proxy, k_proxy, entry_query, entry_dest, items, lse, kl_part,
                        scale: cutlass.Float32, proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32,
                        hp_per_hpk: cutlass.Int32, l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout,
                        l_lse: cute.Layout, gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        gcopy_wg = cp_async_rows(self.dtype, self.head_dim, WARPGROUP_THREADS, self.ROW_THREADS)
        tidx, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        n_entries = items[w, 3]
        if n_entries > 0:
            b, p, start, t0 = self.item_block(items, w, q_proxy.shape[2])
            seqlen, q_t0 = keys_in_query_rows(t0, q, k)
            wg, wg_tidx = warpgroup_of(tidx)
            base = wg * self.stages  # this warpgroup's ring slots
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_k, s_kp = self.key_tiles(storage, l_kv, gcopy, k, k_proxy, b, p // hp_per_hk, p // hp_per_hpk, t0,
                                       seqlen, tidx)
            cute.arch.cp_async_commit_group()
            s_q = storage.s_q.get_tensor(l_rows.outer, swizzle=l_rows.inner)
            s_lse = storage.s_lse.get_tensor(l_lse)

            acc, s_mn, tau, tau_mn, coord = self.wg_accumulators(wg_tidx)
            rows = cute.size(tau_mn, mode=[0])
            scale_log2 = scale * LOG2E  # the main scores' (tau)
            proxy_scale_log2 = proxy_scale * LOG2E  # the proxy scores' (pi, lse_p, the KL's A)
            quad_lane = tidx % 4

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            my_tiles = (n_tiles - wg + 1) // 2  # tiles wg, wg + 2, ...
            gthr = gcopy_wg.get_slice(wg_tidx)
            g_rows = cute.size(gthr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim))), mode=[1])
            i_rows = cute.make_rmem_tensor((g_rows,), cutlass.Int32)  # the gathered tile's queries, per pass
            row_i = cute.make_rmem_tensor((rows,), cutlass.Int32)
            # Prologue: steps 0 .. stages - 2 of the first tile (stages - 1 <= G + 1).
            for v in cutlass.range_constexpr(self.stages - 1):
                self.gather_step(gcopy_wg, q, q_proxy, s_q, s_lse, lse, i_rows, b, p, entry_query, start, n_entries,
                                 wg, my_tiles > 0, cutlass.Int32(v), base + v, wg_tidx)
            cute.arch.cp_async_wait_group(self.stages - 1)  # the key block (its group came first)
            self.publish_async_copies()
            cute.arch.sync_threads()  # the key block came from both warpgroups' threads

            for it in cutlass.range(my_tiles, unroll=1):
                tile = wg + 2 * it
                e0 = start + tile * self.tile_queries
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                # Read here, used by the epilogue G + 1 steps later: the rows' queries, and the tile's first query
                # (entries are sorted by query: only a tile whose first query lies inside the block sees t > i).
                masked = entry_query[e0] < q_t0 + self.block_size - 1
                for r in cutlass.range_constexpr(rows):
                    qi = coord[r, 0][0]
                    row_i[r] = -1
                    if qi < n_q:
                        row_i[r] = entry_query[e0 + qi]
                # The G main heads: a dynamic loop (unrolled, the heads' row and lse addresses would stay live
                # across the tile loop and spill at G = 8, 16).
                tau.fill(0.0)
                for n in cutlass.range(self.group, unroll=1):
                    slot = self.begin_step(gcopy_wg, q, q_proxy, s_q, s_lse, lse, i_rows, b, p, entry_query, start,
                                           n_entries, wg, it, my_tiles, n, base, wg_tidx)
                    self.wg_product(acc, s_q[None, None, slot], s_k, wg_tidx)
                    for r in cutlass.range_constexpr(rows):
                        lse2 = s_lse[coord[r, 0][0], slot, 0] * LOG2E
                        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                            tau_mn[r, c] += cute.math.exp2(s_mn[r, c] * scale_log2 - lse2, fastmath=True)
                # The proxy, then the tile's (A, T, L).
                slot = self.begin_step(gcopy_wg, q, q_proxy, s_q, s_lse, lse, i_rows, b, p, entry_query, start,
                                       n_entries, wg, it, my_tiles, self.group, base, wg_tidx)
                self.wg_product(acc, s_q[None, None, slot], s_kp, wg_tidx)
                if masked:
                    self.write_shares(s_mn, tau_mn, coord, row_i, entry_dest, kl_part, e0, n_q, q_t0, 0, quad_lane,
                                      proxy_scale_log2, True)
                else:
                    self.write_shares(s_mn, tau_mn, coord, row_i, entry_dest, kl_part, e0, n_q, q_t0, 0, quad_lane,
                                      proxy_scale_log2, False)

    @cute.jit
    def begin_step(self, gcopy_wg, q, q_proxy, s_q, s_lse, lse, i_rows, b, p, entry_query, start, n_entries, wg, it,
                   my_tiles, n, base, wg_tidx):
        """Step n of this warpgroup's tile it: wait for its rows, then gather step + stages - 1 into the slot the
        previous step used; returns the step's ring slot."""
        steps = self.group + 1
        u = it * steps + n
        cute.arch.cp_async_wait_group(self.stages - 2)
        self.publish_async_copies()
        # Every thread's rows of step u are in, and every warp is past step u - 1's product and its lse reads.
        cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)
        ahead = n + self.stages - 1
        next_tile = ahead // steps  # 0 or 1: stages - 1 < steps
        ahead_it = it + next_tile
        self.gather_step(gcopy_wg, q, q_proxy, s_q, s_lse, lse, i_rows, b, p, entry_query, start, n_entries,
                         wg + 2 * ahead_it, ahead_it < my_tiles, ahead - steps * next_tile,
                         base + (u + self.stages - 1) % self.stages, wg_tidx)
        return base + u % self.stages

    @cute.jit
    def gather_step(self, gcopy_wg, q, q_proxy, s_q, s_lse, lse, i_rows, b, p, entry_query, start, n_entries,
                    tile, live, n, slot, wg_tidx):
        """cp.async, as one group (empty unless live), this warpgroup's 64 rows of step n of `tile` into ring slot
        `slot`: row r <- q[b, i_r, p*G + n] (n < G) or q_proxy[b, i_r, p] (n = G), i_r = entry_query[e0 + r], read
        from the plan at n = 0 into i_rows and reused by the tile's later steps; with a main head, the row's lse_n
        into the lse table (the lead thread of the row). Rows past the tile's queries: zeros, lse +inf (P = 0)."""
        if live:
            e0 = start + tile * self.tile_queries
            n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
            word = cp_async_word(cutlass.Float32)
            thr = gcopy_wg.get_slice(wg_tidx)
            t_c = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
            t_s = thr.partition_D(s_q[None, None, slot])
            for m in cutlass.range_constexpr(cute.size(t_c, mode=[1])):
                qi = t_c[0, m, 0][0]
                lead = t_c[0, m, 0][1] == 0
                if qi < n_q:
                    if n == 0:
                        i_rows[m] = entry_query[e0 + qi]
                    i = i_rows[m]
                    if n < self.group:
                        copy_row(gcopy_wg, self.dtype, q[b, i, p * self.group + n, None], t_s, t_c, m)
                        if lead:
                            copy_word(word, lse[b, p * self.group + n, None], i, s_lse, qi, slot, 0)
                    else:
                        copy_row(gcopy_wg, self.dtype, q_proxy[b, i, p, None], t_s, t_c, m)
                else:
                    t_s[None, m, None].fill(0)
                    if lead:
                        s_lse[qi, slot, 0] = cutlass.Float32.inf  # read only at main heads
        cute.arch.cp_async_commit_group()
