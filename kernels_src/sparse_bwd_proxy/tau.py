"""The proxy backward reading tau (sm90a, wgmma on the whole key block, any G): heads "tau".

The stepped and resident kernels recompute tau = mean_g exp(s_g - lse_g) from the G main heads' rows: at G = 4 that
is 4 of the 7 products per tile (57 % of the kernel's FLOPs) and 4 of the 5 exponentials per (query, key). The main
backward has those P tiles already (in shared memory, in the input dtype, for dV's product), so with tau_out = 1 it
writes tau per plan entry (kernels_src/sparse_bwd/kernel.py, export_tau), and this kernel reads it back: per tile of
64 distinct queries one contiguous 16 KB block of tau rows (the entries of a tile are consecutive in the plan) and
the proxy rows, gathered two tiles ahead (config.stages = 3 buffers) while S_p runs; then pi = exp(s_p - lse_p),
dS_p = (pi - tau) * kl_grad, and the stepped kernel's dq_p / dk_p products, staging and reductions.
Nothing here depends on G, so one variant per dtype is built (group 1). tau must come from the same plan's sorted
entries (sparse_plan.recut of the main backward's plan): row e of tau belongs to entry e.
Row scalar tables (tile buffer tile % stages): ints [query], floats [lse_p, kl_grad].
Deterministic variants store a tile's dq_p rows at their entries' slot rows of dqp_part (entry_dest; the tensor
named dqp_acc here), which the runtime sums in slot order, and add an item's dk_p in its turn among the items of its
key block (item_prev, item_done: sparse_bwd's take_turn / end_turn).
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.atomics import red_add_f32
from kernels_src.constants import FLT_MIN, LOG2E
from kernels_src.sparse_bwd_proxy.wgmma import SparseProxyBackwardWG
from kernels_src.tiles import copy_row, copy_word, cp_async_rows, cp_async_word, load_rows, row_table, tile_storage
from kernels_src.work_items import keys_in_query_rows

_LSE_P, _KL_GRAD = 0, 1  # float fields


class SparseProxyBackwardTau(SparseProxyBackwardWG):
    def __init__(self, config):
        super().__init__(config)
        if self.tile_n != self.block_size:
            raise ValueError(f"sparse_bwd_proxy heads 'tau': the whole key block per CTA (tile_n = block_size); got "
                             f"tile_n {self.tile_n}, block_size {self.block_size}")

    def _tau_copy(self):
        """The tau rows' copy: rows of block_size keys, whatever the proxy's head dim (its rows take _gmem_copy)."""
        return cp_async_rows(self.dtype, self.tile_n, self.threads, self.ROW_THREADS)

    def _tau_tables(self):
        return row_table(self.tile_m, self.stages, 1), row_table(self.tile_m, self.stages, 2)

    @cute.jit
    def __call__(self, q_proxy: cute.Tensor, k_proxy: cute.Tensor, tau: cute.Tensor, entry_query: cute.Tensor,
                 items: cute.Tensor, lse_proxy: cute.Tensor, kl_grad: cute.Tensor, dqp_acc: cute.Tensor,
                 dkp_acc: cute.Tensor, proxy_scale: cutlass.Float32, hp_per_hpk: cutlass.Int32,
                 stream: cuda.CUstream):
        self.launch(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc, proxy_scale,
                    hp_per_hpk, stream)

    @cute.jit
    def call_det(self, q_proxy: cute.Tensor, k_proxy: cute.Tensor, tau: cute.Tensor, entry_query: cute.Tensor,
                 items: cute.Tensor, lse_proxy: cute.Tensor, kl_grad: cute.Tensor, dqp_part: cute.Tensor,
                 dkp_acc: cute.Tensor, entry_dest: cute.Tensor, item_prev: cute.Tensor, item_done: cute.Tensor,
                 proxy_scale: cutlass.Float32, hp_per_hpk: cutlass.Int32, stream: cuda.CUstream):
        """The deterministic variants' entry: dq_p rows stored to dqp_part, the items' dk_p atomics in turn."""
        self.launch(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_part, dkp_acc, proxy_scale,
                    hp_per_hpk, stream, (entry_dest, item_prev, item_done))

    @cute.jit
    def call_kl(self, q_proxy: cute.Tensor, k_proxy: cute.Tensor, tau: cute.Tensor, entry_query: cute.Tensor,
                items: cute.Tensor, lse_proxy: cute.Tensor, kl_grad: cute.Tensor, dqp_acc: cute.Tensor,
                dkp_acc: cute.Tensor, kl_dest: cute.Tensor, kl_slots: cute.Tensor, proxy_scale: cutlass.Float32,
                hp_per_hpk: cutlass.Int32, stream: cuda.CUstream):
        """kl_value = 1: also each entry's KL share into kl_slots[kl_dest[e]] (see tau_backward)."""
        self.launch(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc, proxy_scale,
                    hp_per_hpk, stream, kl=(kl_dest, kl_slots))

    @cute.jit
    def call_det_kl(self, q_proxy: cute.Tensor, k_proxy: cute.Tensor, tau: cute.Tensor, entry_query: cute.Tensor,
                    items: cute.Tensor, lse_proxy: cute.Tensor, kl_grad: cute.Tensor, dqp_part: cute.Tensor,
                    dkp_acc: cute.Tensor, entry_dest: cute.Tensor, item_prev: cute.Tensor, item_done: cute.Tensor,
                    kl_dest: cute.Tensor, kl_slots: cute.Tensor, proxy_scale: cutlass.Float32,
                    hp_per_hpk: cutlass.Int32, stream: cuda.CUstream):
        """call_det with kl_value = 1."""
        self.launch(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_part, dkp_acc, proxy_scale,
                    hp_per_hpk, stream, (entry_dest, item_prev, item_done), (kl_dest, kl_slots))

    @cute.jit
    def launch(self, q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc, proxy_scale,
               hp_per_hpk, stream, turns=None, kl=None):
        l_kv = self._smem_layout((self.tile_n, self.head_dim))
        l_rows = self._smem_layout((self.tile_m, self.head_dim, self.stages))
        l_tau = self._smem_layout((self.tile_m, self.tile_n, self.stages))
        l_p = self._smem_layout((self.tile_m, self.tile_n))
        l_dq = self._dq_layout()
        l_ri, l_rf = self._tau_tables()

        @cute.struct
        class SharedStorage:
            s_kp: tile_storage(self.dtype, l_kv)
            s_qp: tile_storage(self.dtype, l_rows)
            s_tau: tile_storage(self.dtype, l_tau)
            s_ds: tile_storage(self.dtype, l_p)
            s_dq: tile_storage(cutlass.Float32, l_dq)
            s_ri: tile_storage(cutlass.Int32, l_ri)
            s_rf: tile_storage(cutlass.Float32, l_rf)

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        layouts = (l_kv, l_rows, l_tau, l_p, l_dq, self._gmem_copy(), self._tau_copy(), SharedStorage)
        launch = dict(grid=(items.shape[0], 1, 1), block=(self.threads, 1, 1), smem=self.traced["smem_bytes"],
                      stream=stream)
        if cutlass.const_expr(turns is None and kl is None):
            self.kernel_tau(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                            proxy_scale, hp_per_hpk, *layouts).launch(**launch)
        elif cutlass.const_expr(kl is None):
            self.kernel_tau_det(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                                *turns, proxy_scale, hp_per_hpk, *layouts).launch(**launch)
        elif cutlass.const_expr(turns is None):
            self.kernel_tau_kl(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                               *kl, proxy_scale, hp_per_hpk, *layouts).launch(**launch)
        else:
            self.kernel_tau_det_kl(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                                   *turns, *kl, proxy_scale, hp_per_hpk, *layouts).launch(**launch)

    @cute.kernel
    def kernel_tau(self, q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                   proxy_scale: cutlass.Float32, hp_per_hpk: cutlass.Int32, l_kv: cute.ComposedLayout,
                   l_rows: cute.ComposedLayout, l_tau: cute.ComposedLayout, l_p: cute.ComposedLayout, l_dq: cute.Layout, gcopy: cute.TiledCopy, tcopy: cute.TiledCopy,
                   SharedStorage: cutlass.Constexpr):
        self.tau_backward(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                          proxy_scale, hp_per_hpk, l_kv, l_rows, l_tau, l_p, l_dq, gcopy, tcopy, SharedStorage)

    @cute.kernel
    def kernel_tau_det(self, q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_part, dkp_acc,
                       entry_dest, item_prev, item_done, proxy_scale: cutlass.Float32, hp_per_hpk: cutlass.Int32,
                       l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout, l_tau: cute.ComposedLayout, l_p: cute.ComposedLayout,
                       l_dq: cute.Layout, gcopy: cute.TiledCopy, tcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        self.tau_backward(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_part, dkp_acc,
                          proxy_scale, hp_per_hpk, l_kv, l_rows, l_tau, l_p, l_dq, gcopy, tcopy, SharedStorage,
                          (entry_dest, item_prev, item_done))

    @cute.kernel
    def kernel_tau_kl(self, q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                      kl_dest, kl_slots, proxy_scale: cutlass.Float32, hp_per_hpk: cutlass.Int32,
                      l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout, l_tau: cute.ComposedLayout, l_p: cute.ComposedLayout,
                      l_dq: cute.Layout, gcopy: cute.TiledCopy, tcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        self.tau_backward(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                          proxy_scale, hp_per_hpk, l_kv, l_rows, l_tau, l_p, l_dq, gcopy, tcopy, SharedStorage,
                          kl=(kl_dest, kl_slots))

    @cute.kernel
    def kernel_tau_det_kl(self, q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_part, dkp_acc,
                          entry_dest, item_prev, item_done, kl_dest, kl_slots, proxy_scale: cutlass.Float32,
                          hp_per_hpk: cutlass.Int32, l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout, l_tau: cute.ComposedLayout,
                          l_p: cute.ComposedLayout, l_dq: cute.Layout, gcopy: cute.TiledCopy, tcopy: cute.TiledCopy,
                          SharedStorage: cutlass.Constexpr):
        self.tau_backward(q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_part, dkp_acc,
                          proxy_scale, hp_per_hpk, l_kv, l_rows, l_tau, l_p, l_dq, gcopy, tcopy, SharedStorage,
                          (entry_dest, item_prev, item_done), (kl_dest, kl_slots))

    @cute.jit
    def tau_backward(self, q_proxy, k_proxy, tau, entry_query, items, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                     proxy_scale: cutlass.Float32, hp_per_hpk: cutlass.Int32, l_kv: cute.ComposedLayout,
                     l_rows: cute.ComposedLayout, l_tau: cute.ComposedLayout, l_p: cute.ComposedLayout, l_dq: cute.Layout,
                     gcopy: cute.TiledCopy, tcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr, turns=None, kl=None):
        """The kernel body; turns (entry_dest, item_prev, item_done): the deterministic variant's; kl (kl_dest,
        kl_slots): the kl_value variant's. It forms each entry's KL share in log2 units, sum over its keys of
        tau (log2 tau - log2 pi) with log2 pi = s_p proxy_scale log2 e - lse_p log2 e (the KL pass's A + T lse_p log2 e,
        from the tau rows as read: the input dtype), and adds it into kl_slots[kl_dest[e]]: a warpgroup's half of
        the row's keys each, onto a zero (the runtime's), so either order gives the same sum."""
        tidx, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        n_entries = items[w, 3]
        if n_entries > 0:
            b, p, start, t0 = self.item_block(items, w, q_proxy.shape[2])
            pkh = p // hp_per_hpk
            seqlen, q_t0 = keys_in_query_rows(t0, q_proxy, k_proxy)
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_kp = storage.s_kp.get_tensor(l_kv.outer, swizzle=l_kv.inner)
            s_qp_all = storage.s_qp.get_tensor(l_rows.outer, swizzle=l_rows.inner)
            s_tau_all = storage.s_tau.get_tensor(l_tau.outer, swizzle=l_tau.inner)
            s_ds = storage.s_ds.get_tensor(l_p.outer, swizzle=l_p.inner)
            s_dq = storage.s_dq.get_tensor(l_dq)
            l_ri, l_rf = self._tau_tables()
            s_ri = storage.s_ri.get_tensor(l_ri)
            s_rf = storage.s_rf.get_tensor(l_rf)
            # K_p rows past the sequence are zero (committed with tile 0's group).
            load_rows(gcopy, self.dtype, k_proxy[b, None, pkh, None], s_kp, t0, seqlen, tidx)

            # Made here: a wgmma TiledMma's runtime state (its accumulate flag) would become kernel parameters.
            mma_s, mma_kv = self._score_mma(), self._kv_mma()
            thr_s = mma_s.get_slice(tidx)
            thr_kv = mma_kv.get_slice(tidx)
            acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32)
            sp_mn = self.rows_cols(acc_s)
            tau_r = cute.make_fragment_like(acc_s, self.dtype)
            tau_mn = self.rows_cols(tau_r)
            coord_s = self.rows_cols(thr_s.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
            acc_dq, dq_mn, coord_dq, acc_dkp = self.proxy_gradients(thr_s, thr_kv)
            scale_log2 = proxy_scale * LOG2E  # the proxy scores' (this kernel reads no main score)
            rows_per_thread = cute.size(sp_mn, mode=[0])
            cols = cute.size(sp_mn, mode=[1])

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            # The previous tile's first dq_p row (its first query's row, or deterministic its first entry) and its
            # query count.
            i_prev, n_prev = cutlass.Int32(0), cutlass.Int32(0)
            # The queries of this thread's gather rows of the next tile to gather, loaded a tile ahead of their
            # copies (loaded beside them, each copy waited on its query's global load).
            g_query = cute.make_rmem_tensor((self.gather_row_count(gcopy, tidx),), cutlass.Int32)
            ahead = self.stages - 1  # tiles gathered ahead: one cp.async group each, empty past the item's tiles
            for t in cutlass.range_constexpr(ahead):
                self.tile_queries_of(gcopy, entry_query, start, n_entries, t, tidx, g_query)
                self.gather_tile(gcopy, tcopy, q_proxy, tau, s_qp_all, s_tau_all, s_ri, s_rf, lse_proxy, kl_grad, b, p,
                                 start, n_entries, t, tidx, g_query)
            self.tile_queries_of(gcopy, entry_query, start, n_entries, ahead, tidx, g_query)
            for tile in cutlass.range(n_tiles, unroll=1):
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                e0 = start + tile * self.tile_queries
                tb = tile % self.stages
                s_qp = s_qp_all[None, None, tb]
                cute.arch.cp_async_wait_group(ahead - 1)  # this tile's group; the later tiles' may fly on
                self.publish_async_copies()
                cute.arch.sync_threads()  # this tile's rows and scalars are in; the previous tile is done

                # S_p, with tile + ahead's rows in flight into the buffers tile - 1 left under it.
                self.gemm(mma_s, thr_s, acc_s, s_qp, s_kp, tidx, False, False, wait=False)
                if tile + ahead < n_tiles:
                    self.gather_tile(gcopy, tcopy, q_proxy, tau, s_qp_all, s_tau_all, s_ri, s_rf, lse_proxy, kl_grad, b, p,
                                     start, n_entries, tile + ahead, tidx, g_query)
                    self.tile_queries_of(gcopy, entry_query, start, n_entries, tile + ahead + 1, tidx, g_query)
                else:
                    cute.arch.cp_async_commit_group()  # empty: the wait above counts one group per tile
                if tile > 0:
                    self.reduce_tile(dqp_acc, s_dq, b, p, i_prev, n_prev, tidx)
                i_row = s_ri[tidx % self.tile_m, tb, 0]  # this thread's dq_p row, if it reduces one
                if cutlass.const_expr(turns is not None):  # the thread's entry's slot row of dqp_part
                    i_row = cutlass.Int32(0)
                    if tidx < self.tile_m and tidx < n_q:
                        i_row = turns[0][start + tile * self.tile_queries + tidx]
                src_mn = self.rows_cols(thr_s.partition_C(s_tau_all[None, None, tb]))
                for r in cutlass.range_constexpr(rows_per_thread):
                    cute.autovec_copy(src_mn[r, None], tau_mn[r, None])
                self.wait_products(0)

                # dS_p = (pi - tau) * kl_grad; rows past n_q have query -1 (no key), tau 0 and kl_grad 0.
                for r in cutlass.range_constexpr(rows_per_thread):
                    qi = coord_s[r, 0][0]
                    lsep2 = s_rf[qi, tb, _LSE_P] * LOG2E
                    cg = s_rf[qi, tb, _KL_GRAD]
                    key_limit = self.visible_limit(s_ri[qi, tb, 0], q_t0)
                    share = cutlass.Float32(0.0)
                    for c in cutlass.range_constexpr(cols):
                        pi = cutlass.Float32(0.0)
                        log2_pi = sp_mn[r, c] * scale_log2 - lsep2
                        if coord_s[0, c][1] <= key_limit:
                            pi = cute.math.exp2(log2_pi, fastmath=True)
                        ts = tau_mn[r, c].to(cutlass.Float32)
                        sp_mn[r, c] = (pi - ts) * cg
                        if cutlass.const_expr(kl is not None):
                            # tau = 0 (keys t > i, and underflow) adds 0, as the KL pass's kl_rows.kl_row_sums
                            share += ts * (cute.math.log2(cute.arch.fmax(ts, FLT_MIN), fastmath=True) - log2_pi)
                    if cutlass.const_expr(kl is not None):
                        self.add_kl_share(kl, share, e0 + qi, qi < n_q, tidx)
                self.store_scores(thr_s, acc_s, s_ds)
                self.wait_rows_read(tidx < self.tile_m)  # the previous tile's dq_p rows left s_dq
                self.publish_async_copies()  # dS_p, read next by the MMAs
                cute.arch.sync_threads()

                self.proxy_products(mma_s, thr_s, mma_kv, thr_kv, acc_dq, dq_mn, coord_dq, acc_dkp, s_ds, s_kp, s_qp,
                                    s_dq, proxy_scale, tidx)
                # s_dq is whole; the next tile's dS_p stores and gathers come after every warp's reads.
                cute.arch.sync_threads()
                i_prev, n_prev = i_row, n_q

            self.reduce_tile(dqp_acc, s_dq, b, p, i_prev, n_prev, tidx)
            if cutlass.const_expr(turns is not None):
                self.take_turn(turns, w, tidx)
            self.flush_block(mma_kv, thr_kv, acc_dkp, dkp_acc[b, None, pkh, None], t0, seqlen, proxy_scale)
            if cutlass.const_expr(turns is not None):
                self.end_turn(turns, w, tidx)
            self.wait_rows_done(tidx < self.tile_m)

    @cute.jit
    def add_kl_share(self, kl, share, e, live, tidx):
        """This thread's part of an entry's KL share summed over its quad (the row's keys of this warpgroup), and
        the quad's first lane adds it into kl_slots[kl_dest[e]] (live: the row is one of the tile's entries)."""
        share += cute.arch.shuffle_sync_bfly(share, offset=1)
        share += cute.arch.shuffle_sync_bfly(share, offset=2)
        if live and tidx % 4 == 0:
            kl_dest, kl_slots = kl
            red_add_f32(kl_slots.iterator.toint() + cutlass.Int64(kl_dest[e]) * 4, share)

    @cute.jit
    def reduce_tile(self, dqp_acc, s_dq, b, p, i_row, n_q, tidx):
        """A tile's staged dq_p rows into the fp32 accumulator, one bulk reduction per query (threads 0 .. n_q - 1,
        row i_row each), as one bulk group per issuing thread. Issued under the next tile's S_p product: the bulk
        instructions go out one at a time per SM, and at the tile's end they held the other warps at the next
        tile's first barrier (the main backward's lesson, kernels_src/sparse_bwd/NOTES.md). Deterministic: row
        i_row of dqp_part (the thread's entry), stored."""
        if tidx < self.tile_m:
            if tidx < n_q:
                if cutlass.const_expr(self.deterministic):
                    self.reduce_row(dqp_acc[i_row, None], s_dq, tidx)
                else:
                    self.reduce_row(dqp_acc[b, i_row, p, None], s_dq, tidx)
            cute.arch.cp_async_bulk_commit_group()

    def gather_row_count(self, gcopy, tidx) -> int:
        """Trace time: the rows of a tile this thread copies (a part of each)."""
        return cute.size(gcopy.get_slice(tidx).partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim))),
                         mode=[1])

    @cute.jit
    def tile_queries_of(self, gcopy, entry_query, start, n_entries, tile, tidx, g_query):
        """g_query[m] = the query of this thread's gather row m of `tile` (entry_query[e0 + r]); -1 past the tile's
        queries, or past the item's tiles."""
        e0 = start + tile * self.tile_queries
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        t_c = gcopy.get_slice(tidx).partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(t_c, mode=[1])):
            qi = t_c[0, m, 0][0]
            g_query[m] = -1
            if qi < n_q:
                g_query[m] = entry_query[e0 + qi]

    @cute.jit
    def gather_tile(self, gcopy, tcopy, q_proxy, tau, s_qp_all, s_tau_all, s_ri, s_rf, lse_proxy, kl_grad, b, p, start,
                    n_entries, tile, tidx, g_query):
        """cp.async, as one group, into buffer tile % stages: row r of `tile`'s proxy rows from query i_r (g_query,
        from tile_queries_of) and its tau row e0 + r (contiguous rows: no plan load), and the lead thread of a row
        its scalars (the query as a plain store, read after the next barrier; lse_p and kl_grad). Rows past the
        tile's queries: zeros, query -1 (no key visible), scalars 0."""
        e0 = start + tile * self.tile_queries
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        tb = tile % self.stages
        word = cp_async_word(cutlass.Float32)
        thr = gcopy.get_slice(tidx)
        t_c = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        t_sqp = thr.partition_D(s_qp_all[None, None, tb])
        # tau rows (block_size keys, contiguous from entry e0): their own copy, as wide as the key block
        tthr = tcopy.get_slice(tidx)
        t_ct = tthr.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        t_stau = tthr.partition_D(s_tau_all[None, None, tb])
        for m in cutlass.range_constexpr(cute.size(t_ct, mode=[1])):
            if t_ct[0, m, 0][0] < n_q:
                copy_row(tcopy, self.dtype, tau[e0 + t_ct[0, m, 0][0], None], t_stau, t_ct, m)
            else:
                t_stau[None, m, None].fill(0)
        for m in cutlass.range_constexpr(cute.size(t_c, mode=[1])):
            qi = t_c[0, m, 0][0]
            lead = t_c[0, m, 0][1] == 0
            if qi < n_q:
                i = g_query[m]
                copy_row(gcopy, self.dtype, q_proxy[b, i, p, None], t_sqp, t_c, m)
                if lead:
                    s_ri[qi, tb, 0] = i
                    copy_word(word, lse_proxy[b, p, None], i, s_rf, qi, tb, _LSE_P)
                    copy_word(word, kl_grad[b, p, None], i, s_rf, qi, tb, _KL_GRAD)
            else:
                t_sqp[None, m, None].fill(0)
                if lead:
                    s_ri[qi, tb, 0] = -1
                    s_rf[qi, tb, _LSE_P] = 0.0
                    s_rf[qi, tb, _KL_GRAD] = 0.0
        cute.arch.cp_async_commit_group()
