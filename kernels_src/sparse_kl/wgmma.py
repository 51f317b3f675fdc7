"""MSA KL pass on Hopper's warpgroup MMA (wgmma, sm90a only): one CTA per work item and whole 128-key block,
two warpgroups splitting the block's keys (kernels_src.sparse_bwd.wgmma.WarpgroupTiles: m64n64 each), so a key
group of the (A, T, L) shares is one warpgroup's 64 keys (kl_part columns: group = tidx // 128).

G <= 4 (resident heads): a tile of 64 distinct queries gathers the rows of all G main heads and of the proxy at
once (G + 1 tiles of 16 KB, double buffered: 160 KB with the 64 KB block at G = 4), so a tile is one barrier pair
and G + 1 products, pipelined as in the dense warmup pass (kernels_src.warmup_kl): product n + 1 is issued before
product n's exponentials run. Each row's query and lse_g for the next tile are loaded while this tile runs. Only
tiles whose first (smallest) query lies inside the block can see keys t > i, so only those are masked.
G >= 8 keeps the per-head steps of the mma.sync kernel's loop (SparseKL), whose rows are one head at a time.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.constants import LOG2E
from kernels_src.kl_rows import kl_row_sums, scaled_row_max
from kernels_src.sparse_bwd.wgmma import WarpgroupTiles
from kernels_src.sparse_kl import resident_heads
from kernels_src.sparse_kl.kernel import SparseKL
from kernels_src.tiles import copy_row, tile_storage
from kernels_src.work_items import keys_in_query_rows


class SparseKLWG(WarpgroupTiles, SparseKL):
    def __init__(self, config):
        super().__init__(config)
        self._check_wg_tiles("sparse_kl")
        self.resident = resident_heads(config)

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, q_proxy: cute.Tensor, k_proxy: cute.Tensor,
                 entry_query: cute.Tensor, entry_dest: cute.Tensor, items: cute.Tensor, lse: cute.Tensor,
                 kl_part: cute.Tensor, scale: cutlass.Float32, proxy_scale: cutlass.Float32,
                 hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32, stream: cuda.CUstream):
        if cutlass.const_expr(not self.resident):
            SparseKL.__call__(self, q, k, q_proxy, k_proxy, entry_query, entry_dest, items, lse, kl_part, scale,
                              proxy_scale, hp_per_hk, hp_per_hpk, stream)
        else:
            l_kv = self._smem_layout((self.tile_n, self.head_dim))
            l_rows = self._smem_layout((self.tile_m, self.head_dim, (self.group + 1) * self.stages))

            @cute.struct
            class SharedStorage:
                s_k: tile_storage(self.dtype, l_kv)
                s_kp: tile_storage(self.dtype, l_kv)
                s_q: tile_storage(self.dtype, l_rows)

            self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
            self.kernel_resident(q, k, q_proxy, k_proxy, entry_query, entry_dest, items, lse, kl_part, scale,
                                 proxy_scale, hp_per_hk, hp_per_hpk, l_kv, l_rows, self._gmem_copy(),
                                 SharedStorage).launch(
                grid=(items.shape[0], 1, 1), block=(self.threads, 1, 1), smem=self.traced["smem_bytes"],
                stream=stream)

    @cute.kernel
    def kernel_resident(self, q, k, q_proxy, k_proxy, entry_query, entry_dest, items, lse, kl_part,
                        scale: cutlass.Float32, proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32,
                        hp_per_hpk: cutlass.Int32, l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout,
                        gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        n_entries = items[w, 3]
        if n_entries > 0:
            b, p, start, t0 = self.item_block(items, w, q_proxy.shape[2])
            seqlen, q_t0 = keys_in_query_rows(t0, q, k)
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_k, s_kp = self.key_tiles(storage, l_kv, gcopy, k, k_proxy, b, p // hp_per_hk, p // hp_per_hpk, t0,
                                       seqlen, tidx)
            s_q = storage.s_q.get_tensor(l_rows.outer, swizzle=l_rows.inner)

            mma_s = self._score_mma()
            thr_s = mma_s.get_slice(tidx)
            acc_shape = thr_s.partition_shape_C((self.tile_m, self.tile_n))
            accs = (cute.make_rmem_tensor(acc_shape, cutlass.Float32),
                    cute.make_rmem_tensor(acc_shape, cutlass.Float32))
            tau = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
            tau_mn = self.rows_cols(tau)
            coord = self.rows_cols(thr_s.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
            rows = cute.size(tau_mn, mode=[0])
            scale_log2 = scale * LOG2E  # the main scores' (tau)
            proxy_scale_log2 = proxy_scale * LOG2E  # the proxy scores' (pi, lse_p, the KL's A)
            quad_lane = tidx % 4
            warp_n = tidx // 128  # this warpgroup's half of the block: its key group

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            # Row data of the current tile (query per row, -1 past the tile's queries; lse_g in log2 units, +inf
            # there) and of the next one, loaded a tile ahead.
            row_i = cute.make_rmem_tensor((rows,), cutlass.Int32)
            lse2 = cute.make_rmem_tensor((rows, self.group), cutlass.Float32)
            next_i = cute.make_rmem_tensor((rows,), cutlass.Int32)
            next_lse2 = cute.make_rmem_tensor((rows, self.group), cutlass.Float32)
            self.load_row_data(entry_query, lse, b, p, start, n_entries, 0, coord, row_i, lse2)
            self.gather_heads(gcopy, q, q_proxy, s_q, b, p, entry_query, start, n_entries, 0, tidx)
            for tile in cutlass.range(n_tiles, unroll=1):
                e0 = start + tile * self.tile_queries
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                if cutlass.const_expr(self.stages == 1):
                    # One buffer (D 256): this tile's rows were gathered after the previous tile's last barrier.
                    if tile + 1 < n_tiles:
                        self.load_row_data(entry_query, lse, b, p, start, n_entries, tile + 1, coord, next_i,
                                           next_lse2)
                    cute.arch.cp_async_wait_group(0)
                else:
                    if tile + 1 < n_tiles:
                        self.gather_heads(gcopy, q, q_proxy, s_q, b, p, entry_query, start, n_entries, tile + 1, tidx)
                        self.load_row_data(entry_query, lse, b, p, start, n_entries, tile + 1, coord, next_i,
                                           next_lse2)
                    else:
                        cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(1)
                self.publish_async_copies()
                cute.arch.sync_threads()

                base = (tile % self.stages) * (self.group + 1)
                self.gemm(mma_s, thr_s, accs[0], s_q[None, None, base], s_k, tidx, False, False, wait=False)
                for n in cutlass.range_constexpr(self.group):
                    if cutlass.const_expr(n + 1 < self.group):
                        self.gemm(mma_s, thr_s, accs[(n + 1) % 2], s_q[None, None, base + n + 1], s_k, tidx, False,
                                  False, wait=False)
                    else:
                        self.gemm(mma_s, thr_s, accs[(n + 1) % 2], s_q[None, None, base + self.group], s_kp, tidx,
                                  False, False, wait=False)
                    self.wait_products(1)
                    s_mn = self.rows_cols(accs[n % 2])
                    for r in cutlass.range_constexpr(rows):
                        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                            e = cute.math.exp2(s_mn[r, c] * scale_log2 - lse2[r, n], fastmath=True)
                            if cutlass.const_expr(n == 0):
                                tau_mn[r, c] = e
                            else:
                                tau_mn[r, c] += e
                self.wait_products(0)
                s_mn = self.rows_cols(accs[self.group % 2])
                # Entries are sorted by query: only a tile whose first query lies inside the block sees t > i.
                if entry_query[e0] < q_t0 + self.block_size - 1:
                    self.write_shares(s_mn, tau_mn, coord, row_i, entry_dest, kl_part, e0, n_q, q_t0, warp_n,
                                      quad_lane, proxy_scale_log2, True)
                else:
                    self.write_shares(s_mn, tau_mn, coord, row_i, entry_dest, kl_part, e0, n_q, q_t0, warp_n,
                                      quad_lane, proxy_scale_log2, False)
                for r in cutlass.range_constexpr(rows):
                    row_i[r] = next_i[r]
                    for g in cutlass.range_constexpr(self.group):
                        lse2[r, g] = next_lse2[r, g]
                # The next tile's gathers overwrite what this tile read.
                cute.arch.sync_threads()
                if cutlass.const_expr(self.stages == 1):
                    if tile + 1 < n_tiles:  # one buffer: the next tile's rows only once every warp read these
                        self.gather_heads(gcopy, q, q_proxy, s_q, b, p, entry_query, start, n_entries, tile + 1, tidx)

    @cute.jit
    def tile_entry(self, entry_query, e0, s_ent, qi):
        """The query of the tile's entry qi: from its staged entries when the kernel stages them, else global."""
        if cutlass.const_expr(s_ent is None):
            return entry_query[e0 + qi]
        else:
            return s_ent[qi]

    @cute.jit
    def load_row_data(self, entry_query, lse, b, p, start, n_entries, tile, coord, row_i, lse2, s_ent=None,
                      log2e: cutlass.Constexpr = True):
        """This thread's rows of `tile`: their queries (-1 past the tile's count; from the tile's staged entries
        s_ent when given) and lse_g * log2 e (+inf there, so their P is 0); lse_g itself with log2e False (the
        caller scales it where it is used, so that no instruction waits on the load here)."""
        e0 = start + tile * self.tile_queries
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        for r in cutlass.range_constexpr(cute.size(row_i)):
            qi = coord[r, 0][0]
            row_i[r] = -1
            for g in cutlass.range_constexpr(self.group):
                lse2[r, g] = cutlass.Float32.inf
            if qi < n_q:
                i = self.tile_entry(entry_query, e0, s_ent, qi)
                row_i[r] = i
                for g in cutlass.range_constexpr(self.group):
                    lse2[r, g] = lse[b, p * self.group + g, i]
                    if cutlass.const_expr(log2e):
                        lse2[r, g] = lse2[r, g] * LOG2E

    @cute.jit
    def write_shares(self, s_mn, tau_mn, coord, row_i, entry_dest, kl_part, e0, n_q, t0, warp_n, quad_lane,
                     scale_log2, masked: cutlass.Constexpr):
        """Per row and this warpgroup's 64 keys, in log2 units: A = sum tau (log2 tau - s_p), T = sum tau, L = the
        log2-sum-exp2 of s_p, over the causal keys; written to kl_part[dest, 3 warp_n : 3 warp_n + 3] (tau =
        tau_sum / G). Without masking, every key of the block is visible to every row of the tile."""
        log2_g = math.log2(self.group)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            key_limit = row_i[r] - t0
            row_max = scaled_row_max(s_mn, tau_mn, coord, r, key_limit, scale_log2, masked)
            sum_exp, a_sum, t_sum = kl_row_sums(s_mn, tau_mn, coord, r, key_limit, row_max, masked)
            for off in cutlass.range_constexpr(2):
                sum_exp += cute.arch.shuffle_sync_bfly(sum_exp, offset=2 >> off)
                a_sum += cute.arch.shuffle_sync_bfly(a_sum, offset=2 >> off)
                t_sum += cute.arch.shuffle_sync_bfly(t_sum, offset=2 >> off)
            qi = coord[r, 0][0]
            if qi < n_q and quad_lane == 0:
                lse2_p = -cutlass.Float32.inf
                if sum_exp != 0.0:  # unordered: NaN (a NaN proxy score) stays NaN
                    lse2_p = row_max + cute.math.log2(sum_exp, fastmath=True)
                dest = cutlass.Int64(entry_dest[e0 + qi])
                col = warp_n * 3
                kl_part[dest, col] = (a_sum - log2_g * t_sum) * (1.0 / self.group)
                kl_part[dest, col + 1] = t_sum * (1.0 / self.group)
                kl_part[dest, col + 2] = lse2_p

    @cute.jit
    def gather_heads(self, gcopy, q, q_proxy, s_q, b, p, entry_query, start, n_entries, tile, tidx, base=None,
                     first: cutlass.Constexpr = 0, count: cutlass.Constexpr = None, s_ent=None):
        """cp.async, as one group, row r of heads [first, first + count) of `tile` (default all G main heads and
        the proxy, n = G) into buffers base + n (default stage * (G + 1) + n) from query entry_query[e0 + r] (or
        the tile's staged entries s_ent[r]); rows past the tile's queries are zero-filled. gcopy and tidx: the
        threads that share the copy."""
        e0 = start + tile * self.tile_queries
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        if cutlass.const_expr(base is None):
            base = (tile % self.stages) * (self.group + 1)
        last = first + (self.group + 1 if count is None else count)
        thr = gcopy.get_slice(tidx)
        t_c = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(t_c, mode=[1])):
            qi = t_c[0, m, 0][0]
            if qi < n_q:
                i = self.tile_entry(entry_query, e0, s_ent, qi)
                for n in cutlass.range_constexpr(first, last):
                    t_s = thr.partition_D(s_q[None, None, base + n])
                    if cutlass.const_expr(n < self.group):
                        copy_row(gcopy, self.dtype, q[b, i, p * self.group + n, None], t_s, t_c, m)
                    else:
                        copy_row(gcopy, self.dtype, q_proxy[b, i, p, None], t_s, t_c, m)
            else:
                for n in cutlass.range_constexpr(first, last):
                    thr.partition_D(s_q[None, None, base + n])[None, m, None].fill(0)
        cute.arch.cp_async_commit_group()
