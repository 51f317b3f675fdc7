"""The proxy lse over the selection alone (sm90a, ping-pong on the KL pass's tiles): the `kl_value=0` variant.

Deferred and "none" KL modes need lse_p before the proxy backward (pi = exp(s_p - lse_p)) but no KL value from
this pass. So the KL pass's G main products per tile, its tau exponentials and its log2 per element drop out:
per tile one proxy product and one exponential per (query, key), and one gathered row per entry instead of G + 1
(at (b), G = 4: ~1 / 5 of the pass's products and gathered bytes, ~1 / 6 of its MUFU work).

The ping-pong KL kernel (pingpong.py) with only the proxy head: warpgroup w takes tiles w, w + 2, ... of the item,
gathers its tile's proxy rows into its own buffer behind its own named barrier (the next tile's as soon as every
warp of the warpgroup is past this tile's product), the entries two tiles ahead in the same two-slot ring. Its
row statistics are the KL pass's (kernels_src.kl_rows.scaled_row_max and lse_row_part, the same product on the
same operands), so each entry's L, and with it lse_p after sparse_combine_kl, is the KL pass's bit for bit. It
writes (0, 0, L) per entry, so kl_rows come out 0 (lse_p times a T of 0; NaN where lse_p is). Nothing depends
on G: one variant per dtype and head dim (group 1), any G's plan. Its own ABI: no main q, k or lse.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.barriers import SparseKLPingPong as Bar
from kernels_src.constants import LOG2E, WARPGROUP_THREADS
from kernels_src.kl_rows import lse_row_part, scaled_row_max
from kernels_src.sparse_kl.pingpong import ENTRY_RING, SparseKLPingPong
from kernels_src.tiles import copy_row, cp_async_rows, load_rows, tile_storage, warpgroup_of
from kernels_src.work_items import keys_in_query_rows


class SparseProxyLse(SparseKLPingPong):
    @cute.jit
    def __call__(self, q_proxy: cute.Tensor, k_proxy: cute.Tensor, entry_query: cute.Tensor,
                 entry_dest: cute.Tensor, items: cute.Tensor, kl_part: cute.Tensor, proxy_scale: cutlass.Float32,
                 hp_per_hpk: cutlass.Int32, stream: cuda.CUstream):
        l_kv = self._smem_layout((self.tile_n, self.head_dim))
        l_rows = self._smem_layout((self.tile_m, self.head_dim, 2))  # buffer w: warpgroup w's proxy rows

        @cute.struct
        class SharedStorage:
            s_kp: tile_storage(self.dtype, l_kv)
            s_q: tile_storage(self.dtype, l_rows)
            s_ent: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, ENTRY_RING * self.tile_m * 2], 1024]

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_lse(q_proxy, k_proxy, entry_query, entry_dest, items, kl_part, proxy_scale, hp_per_hpk, l_kv,
                        l_rows,
                        self._gmem_copy(), SharedStorage).launch(
            grid=(items.shape[0], 1, 1), block=(self.threads, 1, 1), smem=self.traced["smem_bytes"], stream=stream)

    @cute.kernel
    def kernel_lse(self, q_proxy, k_proxy, entry_query, entry_dest, items, kl_part, proxy_scale: cutlass.Float32,
                   hp_per_hpk: cutlass.Int32, l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout,
                   gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        """gcopy loads the key block with all 256 threads; a 128-thread copy of the same atoms gathers a
        warpgroup's rows."""
        gcopy_wg = cp_async_rows(self.dtype, self.head_dim, WARPGROUP_THREADS, self.ROW_THREADS)
        tidx, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        n_entries = items[w, 3]
        if n_entries > 0:
            b, p, start, t0 = self.item_block(items, w, q_proxy.shape[2])
            seqlen, q_t0 = keys_in_query_rows(t0, q_proxy, k_proxy)
            wg, wg_tidx = warpgroup_of(tidx)
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_kp = storage.s_kp.get_tensor(l_kv.outer, swizzle=l_kv.inner)
            # K_p rows past the sequence are zero (committed with the ring's group below).
            load_rows(gcopy, self.dtype, k_proxy[b, None, p // hp_per_hpk, None], s_kp, t0, seqlen, tidx)
            s_q = storage.s_q.get_tensor(l_rows.outer, swizzle=l_rows.inner)[None, None, wg]

            acc, s_mn, _, _, coord = self.wg_accumulators(wg_tidx)
            rows = cute.size(s_mn, mode=[0])
            scale_log2 = proxy_scale * LOG2E
            quad_lane = tidx % 4

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            my_tiles = (n_tiles - wg + 1) // 2  # tiles wg, wg + 2, ...
            row_i = cute.make_rmem_tensor((rows,), cutlass.Int32)
            # ring[w, it % 2]: the entries of warpgroup w's it-th tile (wg + 2 it)
            ring = storage.s_ent.get_tensor(cute.make_layout((self.tile_m, ENTRY_RING, 2)))
            if my_tiles > 0:
                self.stage_entries(entry_query, ring[None, 0, wg], start, n_entries, wg, wg_tidx)
                self.stage_entries(entry_query, ring[None, 1, wg], start, n_entries, wg + 2, wg_tidx)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)  # the ring's group, which also holds the key block's copies
                cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)
                self.gather_proxy(gcopy_wg, q_proxy, s_q, b, p, start, n_entries, wg, wg_tidx, ring[None, 0, wg])
            cute.arch.cp_async_wait_group(0)
            self.publish_async_copies()
            cute.arch.sync_threads()  # the key block came from both warpgroups' threads

            for it in cutlass.range(my_tiles, unroll=1):
                tile = wg + 2 * it
                e0 = start + tile * self.tile_queries
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                self.await_rows(it, wg)
                s_this = ring[None, it % ENTRY_RING, wg]
                # Entries are sorted by query: only a tile whose first query lies inside the block sees t > i.
                masked = s_this[0] < q_t0 + self.block_size - 1
                for r in cutlass.range_constexpr(rows):
                    qi = coord[r, 0][0]
                    row_i[r] = -1
                    if qi < n_q:
                        row_i[r] = s_this[qi]
                self.wg_product(acc, s_q, s_kp, wg_tidx)
                if tile + 2 < n_tiles:
                    # Every warp of the warpgroup is past its wait: the buffer takes tile + 2's rows, and this
                    # tile's ring slot (read above) tile + 4's entries, in one group.
                    cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)
                    self.stage_entries(entry_query, ring[None, it % ENTRY_RING, wg], start, n_entries, tile + 4,
                                       wg_tidx)
                    self.gather_proxy(gcopy_wg, q_proxy, s_q, b, p, start, n_entries, tile + 2, wg_tidx,
                                      ring[None, (it + 1) % ENTRY_RING, wg])
                if masked:
                    self.write_lse(s_mn, coord, row_i, entry_dest, kl_part, e0, n_q, q_t0, quad_lane, scale_log2,
                                   True)
                else:
                    self.write_lse(s_mn, coord, row_i, entry_dest, kl_part, e0, n_q, q_t0, quad_lane, scale_log2,
                                   False)

    @cute.jit
    def gather_proxy(self, gcopy, q_proxy, s_q, b, p, start, n_entries, tile, wg_tidx, s_ent):
        """cp.async, as one group, row r of `tile`'s proxy rows from query s_ent[r] (its staged entries) into s_q;
        rows past the tile's queries are zero-filled."""
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        thr = gcopy.get_slice(wg_tidx)
        t_c = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        t_s = thr.partition_D(s_q)
        for m in cutlass.range_constexpr(cute.size(t_c, mode=[1])):
            qi = t_c[0, m, 0][0]
            if qi < n_q:
                copy_row(gcopy, self.dtype, q_proxy[b, s_ent[qi], p, None], t_s, t_c, m)
            else:
                t_s[None, m, None].fill(0)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def write_lse(self, s_mn, coord, row_i, entry_dest, kl_part, e0, n_q, t0, quad_lane, scale_log2,
                  masked: cutlass.Constexpr):
        """Per row, L = the log2-sum-exp2 of s_p over its causal keys, as write_shares forms it, written with
        A = T = 0 to kl_part[dest]."""
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            key_limit = row_i[r] - t0
            row_max = scaled_row_max(s_mn, None, coord, r, key_limit, scale_log2, masked)
            sum_exp = lse_row_part(s_mn, coord, r, key_limit, row_max, masked)
            for off in cutlass.range_constexpr(2):
                sum_exp += cute.arch.shuffle_sync_bfly(sum_exp, offset=2 >> off)
            qi = coord[r, 0][0]
            if qi < n_q and quad_lane == 0:
                lse2_p = -cutlass.Float32.inf
                if sum_exp != 0.0:  # unordered: NaN (a NaN proxy score) stays NaN
                    lse2_p = row_max + cute.math.log2(sum_exp, fastmath=True)
                dest = cutlass.Int64(entry_dest[e0 + qi])
                kl_part[dest, 0] = 0.0
                kl_part[dest, 1] = 0.0
                kl_part[dest, 2] = lse2_p
