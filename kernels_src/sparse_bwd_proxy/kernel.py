"""MSA proxy backward (CuTeDSL): tiles of 64 distinct queries, the G main heads visited one after another.

Per CTA: one work item (key block j of (b, p)) and one 64-key slice of it, as the main backward. Per tile of 64
queries (8 warps, 4 x 2 over queries x keys):
  1. for each head g of the proxy group, the gathered rows q[b, i, p*G + g] give S_g = Q_g K^T and
     P_g = exp(S_g - lse_g) (causal); tau_sum = sum_g P_g accumulates in registers (same thread, same (i, t)),
     while the next head's rows are in flight (the (tile, head) steps are double buffered); tau = tau_sum / G;
  2. the proxy rows q_proxy[b, i, p] give pi = exp(s_p - lse_p), and dS_p = (pi - tau) * kl_grad[b, p, i];
  3. dq_p = proxy_scale * dS_p K_p (staged in shared memory, one bulk reduction per query row into the fp32
     accumulator, where the K slots of a query meet) and
     dk_p += proxy_scale * dS_p^T Q_p (registers across the item's tiles, atomics at its end).
The proxy products run once per query, not once per (query, head): the first version replicated the proxy row
over the G heads' rows and spent G times the proxy FLOPs (NOTES.md).
Row scalars travel with the gathers (tiles.copy_word): the tile's query indices (read from the plan once per tile,
at g = 0, and kept in the gathering threads' registers for the later heads), each step's lse_g, and the query's
lse_p and kl_grad, so no step waits on a chain of global loads between its product and its exponentials
((b) S = 64K: 36.9 -> 32.0 ms, NOTES.md, "Measured").
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.constants import LOG2E
from kernels_src.sparse_bwd.kernel import SparseBackward
from kernels_src.tiles import copy_row, copy_word, cp_async_word, row_table, tile_storage, transposed
from kernels_src.work_items import item_block, item_slice, keys_in_query_rows


# The staged row-scalar tables (rows = the tile's distinct queries): ints [query, ...], floats [lse_g of the step,
# ...]; the query fields live in buffer tile % stages, the step's lse_g in buffer step % stages.
QUERY, LSE_G, LSE_P, KL_GRAD = 0, 0, 1, 2


class SparseProxyBackward(SparseBackward):
    query_ints = 1  # the query index
    row_floats = 3  # lse_g, lse_p, kl_grad

    def __init__(self, config):
        super().__init__(config)
        self.tile_queries = config.tile_m  # distinct queries per tile (not (query, head) rows)

    def item_block(self, items, w, hp):
        """Trace time: work item w's batch b, proxy head p (bp = b * Hp + p), first entry and key block start, for
        the kernels that take the whole key block per CTA."""
        return item_block(items, w, hp, self.block_size)

    def proxy_gradients(self, thr_s, thr_kv):
        """Trace time: this thread's dq_p accumulator (rows x D, in the score MMA's partition) with its rows x
        columns view and coordinates, and the zeroed dk_p accumulator (keys x D) kept across the item."""
        cols = self.head_dim // self.dq_pieces()
        acc_dq = cute.make_rmem_tensor(thr_s.partition_shape_C((self.tile_m, cols)), cutlass.Float32)
        dq_mn = self.rows_cols(acc_dq)
        coord_dq = self.rows_cols(thr_s.partition_C(cute.make_identity_tensor((self.tile_m, cols))))
        acc_dkp = cute.make_rmem_tensor(thr_kv.partition_shape_C((self.tile_n, self.head_dim)), cutlass.Float32)
        acc_dkp.fill(0.0)
        return acc_dq, dq_mn, coord_dq, acc_dkp

    @cute.jit
    def proxy_products(self, mma_s, thr_s, mma_kv, thr_kv, acc_dq, dq_mn, coord_dq, acc_dkp, s_ds, s_kp, s_qp, s_dq,
                       scale, tidx):
        """dq_p = scale * dS_p K_p (this CTA's keys; scale: the proxy scale), staged in s_dq while
        dk_p += dS_p^T Q_p finishes."""
        if cutlass.const_expr(self.dq_pieces() == 1):
            self.gemm(mma_s, thr_s, acc_dq, s_ds, transposed(s_kp), tidx, False, True, wait=False)
            self.gemm(mma_kv, thr_kv, acc_dkp, transposed(s_ds), transposed(s_qp), tidx, True, True,
                      accumulate=True, wait=False)
            self.wait_products(1)
            self.stage_rows(s_dq, dq_mn, coord_dq, scale)
            self.wait_products(0)
        else:
            cols = self.head_dim // self.dq_pieces()
            for h in cutlass.range_constexpr(self.dq_pieces()):
                self.gemm(mma_s, thr_s, acc_dq, s_ds, cute.local_tile(transposed(s_kp), (cols, self.tile_n), (h, 0)),
                          tidx, False, True)
                self.stage_rows(cute.local_tile(s_dq, (self.tile_m, cols), (0, h)), dq_mn, coord_dq, scale)
            self.gemm(mma_kv, thr_kv, acc_dkp, transposed(s_ds), transposed(s_qp), tidx, True, True, accumulate=True)

    def key_tiles(self, storage, l_kv, gcopy, k, k_proxy, b, kvh, pkh, t0, seqlen, tidx):
        """Trace time: the item's K (kv head kvh) and K_p (proxy key head pkh) tiles in shared memory, their
        cp.async loads issued by every thread (committed with the caller's first group)."""
        s_k = storage.s_k.get_tensor(l_kv.outer, swizzle=l_kv.inner)
        s_kp = storage.s_kp.get_tensor(l_kv.outer, swizzle=l_kv.inner)
        self.load_block(gcopy, k[b, None, kvh, None], s_k, t0, seqlen, tidx)
        self.load_block(gcopy, k_proxy[b, None, pkh, None], s_kp, t0, seqlen, tidx)
        return s_k, s_kp

    def _row_tables(self):
        return (row_table(self.tile_m, self.stages, self.query_ints),
                row_table(self.tile_m, self.stages, self.row_floats))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, q_proxy: cute.Tensor, k_proxy: cute.Tensor,
                 entry_query: cute.Tensor, items: cute.Tensor, lse: cute.Tensor, lse_proxy: cute.Tensor,
                 kl_grad: cute.Tensor, dqp_acc: cute.Tensor, dkp_acc: cute.Tensor, scale: cutlass.Float32,
                 proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32,
                 stream: cuda.CUstream):
        l_kv = self._smem_layout((self.tile_n, self.head_dim))
        l_rows = self._smem_layout((self.tile_m, self.head_dim, self.stages))
        l_p = self._smem_layout((self.tile_m, self.tile_n))
        l_dq = self._dq_layout()
        l_ri, l_rf = self._row_tables()

        @cute.struct
        class SharedStorage:
            s_k: tile_storage(self.dtype, l_kv)
            s_kp: tile_storage(self.dtype, l_kv)
            s_q: tile_storage(self.dtype, l_rows)
            s_qp: tile_storage(self.dtype, l_rows)
            s_ds: tile_storage(self.dtype, l_p)
            s_dq: tile_storage(cutlass.Float32, l_dq)
            s_ri: tile_storage(cutlass.Int32, l_ri)
            s_rf: tile_storage(cutlass.Float32, l_rf)

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_proxy(q, k, q_proxy, k_proxy, entry_query, items, lse, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                          scale, proxy_scale, hp_per_hk, hp_per_hpk, l_kv, l_rows, l_p, l_dq, self._gmem_copy(),
                          SharedStorage).launch(
            grid=(items.shape[0] * self.halves, 1, 1), block=(self.threads, 1, 1), smem=self.traced["smem_bytes"],
            stream=stream)

    @cute.kernel
    def kernel_proxy(self, q, k, q_proxy, k_proxy, entry_query, items, lse, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                     scale: cutlass.Float32, proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32,
                     hp_per_hpk: cutlass.Int32, l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout,
                     l_p: cute.ComposedLayout, l_dq: cute.Layout, gcopy: cute.TiledCopy,
                     SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        w = cta // self.halves
        n_entries = items[w, 3]
        if n_entries > 0:
            # This CTA's keys: one tile_n slice of the item's key block (tau and pi are per key: the slices are
            # independent).
            b, p, start, t0 = item_slice(items, w, cta, self.halves, q_proxy.shape[2], self.block_size, self.tile_n)
            pkh = p // hp_per_hpk
            seqlen, q_t0 = keys_in_query_rows(t0, q, k)
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_k = storage.s_k.get_tensor(l_kv.outer, swizzle=l_kv.inner)
            s_kp = storage.s_kp.get_tensor(l_kv.outer, swizzle=l_kv.inner)
            s_q_all = storage.s_q.get_tensor(l_rows.outer, swizzle=l_rows.inner)
            s_qp_all = storage.s_qp.get_tensor(l_rows.outer, swizzle=l_rows.inner)
            s_ds = storage.s_ds.get_tensor(l_p.outer, swizzle=l_p.inner)
            s_dq = storage.s_dq.get_tensor(l_dq)
            l_ri, l_rf = self._row_tables()
            s_ri = storage.s_ri.get_tensor(l_ri)
            s_rf = storage.s_rf.get_tensor(l_rf)
            self.load_block(gcopy, k[b, None, p // hp_per_hk, None], s_k, t0, seqlen, tidx)
            self.load_block(gcopy, k_proxy[b, None, pkh, None], s_kp, t0, seqlen, tidx)

            # Made here: a wgmma TiledMma's runtime state (its accumulate flag) would become kernel parameters.
            mma_s, mma_kv = self._score_mma(), self._kv_mma()
            thr_s = mma_s.get_slice(tidx)
            thr_kv = mma_kv.get_slice(tidx)
            acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32)
            tau = cute.make_rmem_tensor(thr_s.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32)
            s_mn, tau_mn = self.rows_cols(acc_s), self.rows_cols(tau)
            coord_s = self.rows_cols(thr_s.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
            acc_dq, dq_mn, coord_dq, acc_dkp = self.proxy_gradients(thr_s, thr_kv)
            scale_log2 = scale * LOG2E  # the main scores' (tau)
            proxy_scale_log2 = proxy_scale * LOG2E  # the proxy scores' (pi; proxy_scale also scales dq_p, dk_p)
            rows_per_thread = cute.size(s_mn, mode=[0])
            query_srcs = (lse_proxy[b, p, None], kl_grad[b, p, None])
            i_rows = cute.make_rmem_tensor((self.tile_m * self.head_dim // 8 // self.threads,), cutlass.Int32)

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            n_steps = n_tiles * self.group  # (tile, head) steps: step = tile * G + g
            # stages - 1 steps gathered ahead (their tiles span at most stages tile buffers); empty groups past
            # the last step keep the group count.
            ahead = self.stages - 1
            for t in cutlass.range_constexpr(ahead):
                if t < n_steps:
                    self.gather_step(gcopy, q, q_proxy, s_q_all, s_qp_all, s_ri, s_rf, i_rows, lse, query_srcs, b, p,
                                     entry_query, start, n_entries, t, tidx)
                else:
                    cute.arch.cp_async_commit_group()
            for step in cutlass.range(n_steps, unroll=1):
                tile = step // self.group
                g = step - tile * self.group
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                tb = tile % self.stages
                s_q = s_q_all[None, None, step % self.stages]
                if step + ahead < n_steps:
                    self.gather_step(gcopy, q, q_proxy, s_q_all, s_qp_all, s_ri, s_rf, i_rows, lse, query_srcs, b, p,
                                     entry_query, start, n_entries, step + ahead, tidx)
                else:
                    cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(ahead)
                self.publish_async_copies()
                cute.arch.sync_threads()

                # tau_sum += P_g on the causal keys of each query (rows past n_q: nothing).
                if g == 0:
                    tau.fill(0.0)
                self.accumulate_tau(mma_s, thr_s, acc_s, s_mn, tau_mn, coord_s, s_q, s_k, s_ri, s_rf, tb,
                                    step % self.stages, q_t0, scale_log2, tidx)

                # This thread's dq_p row (read before the barrier below: the next gathers may overwrite it).
                i_row = s_ri[tidx % self.tile_m, tb, QUERY]
                if g == self.group - 1:
                    # dS_p = (pi - tau) * kl_grad on the tile's distinct queries.
                    s_qp = s_qp_all[None, None, tb]
                    self.gemm(mma_s, thr_s, acc_s, s_qp, s_kp, tidx, False, False)
                    for r in cutlass.range_constexpr(rows_per_thread):
                        qi = coord_s[r, 0][0]
                        lsep2 = s_rf[qi, tb, LSE_P] * LOG2E
                        cg = s_rf[qi, tb, KL_GRAD]
                        key_limit = self.visible_limit(s_ri[qi, tb, QUERY], q_t0)  # -1 past n_q
                        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                            pi = cutlass.Float32(0.0)
                            if coord_s[0, c][1] <= key_limit:
                                pi = cute.math.exp2(s_mn[r, c] * proxy_scale_log2 - lsep2, fastmath=True)
                            s_mn[r, c] = (pi - tau_mn[r, c] * (1.0 / self.group)) * cg
                    self.store_scores(thr_s, acc_s, s_ds)
                    self.wait_rows_read(tidx < self.tile_m)  # the previous tile's dq_p rows left s_dq
                    self.publish_async_copies()  # dS_p, read next by the MMAs
                    cute.arch.sync_threads()

                    self.proxy_products(mma_s, thr_s, mma_kv, thr_kv, acc_dq, dq_mn, coord_dq, acc_dkp, s_ds, s_kp,
                                        s_qp, s_dq, proxy_scale, tidx)
                # The next steps' gathers and dS_p stores overwrite what this step read; s_dq is whole.
                cute.arch.sync_threads()
                if g == self.group - 1:
                    if tidx < self.tile_m:
                        if tidx < n_q:
                            self.reduce_row(dqp_acc[b, i_row, p, None], s_dq, tidx)
                        cute.arch.cp_async_bulk_commit_group()

            self.flush_block(mma_kv, thr_kv, acc_dkp, dkp_acc[b, None, pkh, None], t0, seqlen, proxy_scale)
            self.wait_rows_done(tidx < self.tile_m)

    @cute.jit
    def accumulate_tau(self, mma_s, thr_s, acc_s, s_mn, tau_mn, coord_s, s_q, s_k, s_ri, s_rf, tb, sb, t0,
                       scale_log2, tidx):
        """tau_sum += exp(s_g - lse_g) over the tile's queries and this CTA's keys (causal; rows past n_q, whose
        staged query is -1: nothing). The queries and lse_g come from the staged row tables."""
        self.gemm(mma_s, thr_s, acc_s, s_q, s_k, tidx, False, False)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            qi = coord_s[r, 0][0]
            lse2 = s_rf[qi, sb, LSE_G] * LOG2E
            key_limit = self.visible_limit(s_ri[qi, tb, QUERY], t0)
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if coord_s[0, c][1] <= key_limit:
                    tau_mn[r, c] += cute.math.exp2(s_mn[r, c] * scale_log2 - lse2, fastmath=True)

    @cute.jit
    def visible_limit(self, i, q_t0):
        """The last key of the CTA's keys that query row i sees, i - q_t0 (q_t0: the CTA's first key in query
        rows), or -1 for a row past the tile's queries (staged query -1): no key, whatever the keys' offset."""
        limit = -1
        if i >= 0:
            limit = i - q_t0
        return limit

    @cute.jit
    def stage_query(self, word_f, word_i, s_ri, s_rf, query_srcs, qi, tb, i, e):
        """The tile's per-query scalars beyond the query itself (tile buffer tb): lse_p and kl_grad of query i."""
        copy_word(word_f, query_srcs[0], i, s_rf, qi, tb, LSE_P)
        copy_word(word_f, query_srcs[1], i, s_rf, qi, tb, KL_GRAD)

    @cute.jit
    def clear_query(self, s_ri, s_rf, qi, tb):
        """A row past the tile's queries: no key is visible (query -1) and its scalars are zero."""
        s_ri[qi, tb, QUERY] = -1
        s_rf[qi, tb, LSE_P] = 0.0
        s_rf[qi, tb, KL_GRAD] = 0.0

    @cute.jit
    def gather_step(self, gcopy, q, q_proxy, s_q_all, s_qp_all, s_ri, s_rf, i_rows, lse, query_srcs, b, p,
                    entry_query, start, n_entries, step, tidx):
        """cp.async, as one group, row r <- q[b, i_r, p*G + g] (i_r = entry_query[e0 + r]) for step = tile*G + g into
        q buffer step % stages and, at g = 0, row r <- q_proxy[b, i_r, p] into proxy buffer tile % stages. Rows past
        the tile's queries are zero-filled. The first thread of each row stages the row's scalars with the same
        group: at g = 0 the query (a plain store, read after this step's barrier) and the query's scalars
        (stage_query), at every step lse_g[i_r]. i_rows: this thread's rows' queries, read from the plan at g = 0
        and reused by the tile's later heads."""
        tile = step // self.group
        g = step - tile * self.group
        e0 = start + tile * self.tile_queries
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        tb = tile % self.stages
        sb = step % self.stages
        word_f, word_i = cp_async_word(cutlass.Float32), cp_async_word(cutlass.Int32)
        lse_g = lse[b, p * self.group + g, None]
        thr = gcopy.get_slice(tidx)
        t_c = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        t_sq = thr.partition_D(s_q_all[None, None, sb])
        t_sqp = thr.partition_D(s_qp_all[None, None, tb])
        for m in cutlass.range_constexpr(cute.size(t_sq, mode=[1])):
            qi = t_c[0, m, 0][0]
            lead = t_c[0, m, 0][1] == 0
            if qi < n_q:
                # The query: from the plan at g = 0, kept in this thread's registers for the tile's later heads.
                if g == 0:
                    i_rows[m] = entry_query[e0 + qi]
                i = i_rows[m]
                copy_row(gcopy, self.dtype, q[b, i, p * self.group + g, None], t_sq, t_c, m)
                if lead:
                    copy_word(word_f, lse_g, i, s_rf, qi, sb, LSE_G)
                if g == 0:
                    copy_row(gcopy, self.dtype, q_proxy[b, i, p, None], t_sqp, t_c, m)
                    if lead:
                        s_ri[qi, tb, QUERY] = i
                        self.stage_query(word_f, word_i, s_ri, s_rf, query_srcs, qi, tb, i, e0 + qi)
            else:
                t_sq[None, m, None].fill(0)
                if lead:
                    s_rf[qi, sb, LSE_G] = 0.0
                if g == 0:
                    t_sqp[None, m, None].fill(0)
                    if lead:
                        self.clear_query(s_ri, s_rf, qi, tb)
        cute.arch.cp_async_commit_group()
