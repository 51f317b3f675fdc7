"""The proxy backward on wgmma with a tile's heads resident (sm90a only, G <= 4): the KL pass's resident-heads
layout (kernels_src/sparse_kl/wgmma.py) applied to the proxy's gradients.

The stepped kernel (kernel.py on wgmma) visits a tile's G main heads one step at a time: per step a CTA barrier
for its gathered rows, one product waited for at once, its exponentials, another CTA barrier before the next
gather; so 2 G + 2 barriers a tile and no product in flight under any exponential. Here a tile's G main head rows
and its proxy rows are gathered together, so a tile has four CTA barriers, and the G + 1 score products S_0 ..
S_{G-1}, S_p go through two accumulators: product n + 1 is issued before product n's exponentials run. Shared
memory holds the G main head tiles once (16 KB each), the proxy rows and the row scalars twice: the next tile's
rows are gathered as soon as every warp's last main product is done, and fly under this tile's proxy product,
dS_p, the dq_p / dk_p products and the dq_p reductions. The rest is the stepped kernel's: the two warpgroups
split the block's 128 keys, dS_p = (pi - tau) * kl_grad is staged in shared memory for dq_p = dS_p K_p (staged
rows, one bulk reduction per query) and dk_p += dS_p^T Q_p (registers across the item, atomics at its end).
Row scalar tables (tile buffer tile % 2): ints [query], floats [lse_0 .. lse_{G-1}, lse_p, kl_grad].
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.constants import LOG2E
from kernels_src.sparse_bwd_proxy.wgmma import SparseProxyBackwardWG
from kernels_src.tiles import copy_row, copy_word, cp_async_word, row_table, tile_storage
from kernels_src.work_items import keys_in_query_rows

_TILE_BUFFERS = 2  # proxy rows and row scalars: this tile's and the next one's


class SparseProxyBackwardResident(SparseProxyBackwardWG):
    ROW_THREADS = None  # at 255 registers: 8 or 4 threads per row spill 8 / 24 bytes at G = 4

    def __init__(self, config):
        super().__init__(config)
        if self.group > 4 or self.tile_n != self.block_size:
            raise ValueError(f"sparse_bwd_proxy resident heads: G <= 4 on the whole key block; got G {self.group}, "
                             f"tile_n {self.tile_n}")
        self.lse_p_field = self.group  # floats: lse_g for g < G, then lse_p, kl_grad
        self.kl_grad_field = self.group + 1

    def _resident_tables(self):
        return (row_table(self.tile_m, _TILE_BUFFERS, 1), row_table(self.tile_m, _TILE_BUFFERS, self.group + 2))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, q_proxy: cute.Tensor, k_proxy: cute.Tensor,
                 entry_query: cute.Tensor, items: cute.Tensor, lse: cute.Tensor, lse_proxy: cute.Tensor,
                 kl_grad: cute.Tensor, dqp_acc: cute.Tensor, dkp_acc: cute.Tensor, scale: cutlass.Float32,
                 proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32,
                 stream: cuda.CUstream):
        l_kv = self._smem_layout((self.tile_n, self.head_dim))
        l_heads = self._smem_layout((self.tile_m, self.head_dim, self.group))
        l_proxy = self._smem_layout((self.tile_m, self.head_dim, _TILE_BUFFERS))
        l_p = self._smem_layout((self.tile_m, self.tile_n))
        l_dq = self._dq_layout()
        l_ri, l_rf = self._resident_tables()

        @cute.struct
        class SharedStorage:
            s_k: tile_storage(self.dtype, l_kv)
            s_kp: tile_storage(self.dtype, l_kv)
            s_q: tile_storage(self.dtype, l_heads)
            s_qp: tile_storage(self.dtype, l_proxy)
            s_ds: tile_storage(self.dtype, l_p)
            s_dq: tile_storage(cutlass.Float32, l_dq)
            s_ri: tile_storage(cutlass.Int32, l_ri)
            s_rf: tile_storage(cutlass.Float32, l_rf)

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_resident(q, k, q_proxy, k_proxy, entry_query, items, lse, lse_proxy, kl_grad, dqp_acc, dkp_acc,
                             scale, proxy_scale, hp_per_hk, hp_per_hpk, l_kv, l_heads, l_proxy, l_p, l_dq,
                             self._gmem_copy(), SharedStorage).launch(
            grid=(items.shape[0], 1, 1), block=(self.threads, 1, 1), smem=self.traced["smem_bytes"], stream=stream)

    @cute.kernel
    def kernel_resident(self, q, k, q_proxy, k_proxy, entry_query, items, lse, lse_proxy, kl_grad, dqp_acc,
                        dkp_acc, scale: cutlass.Float32, proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32,
                        hp_per_hpk: cutlass.Int32, l_kv: cute.ComposedLayout, l_heads: cute.ComposedLayout,
                        l_proxy: cute.ComposedLayout, l_p: cute.ComposedLayout, l_dq: cute.Layout,
                        gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        n_entries = items[w, 3]
        if n_entries > 0:
            b, p, start, t0 = self.item_block(items, w, q_proxy.shape[2])
            pkh = p // hp_per_hpk
            seqlen, q_t0 = keys_in_query_rows(t0, q, k)
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_k, s_kp = self.key_tiles(storage, l_kv, gcopy, k, k_proxy, b, p // hp_per_hk, pkh, t0, seqlen, tidx)
            s_heads = storage.s_q.get_tensor(l_heads.outer, swizzle=l_heads.inner)
            s_qp_all = storage.s_qp.get_tensor(l_proxy.outer, swizzle=l_proxy.inner)
            s_ds = storage.s_ds.get_tensor(l_p.outer, swizzle=l_p.inner)
            s_dq = storage.s_dq.get_tensor(l_dq)
            l_ri, l_rf = self._resident_tables()
            s_ri = storage.s_ri.get_tensor(l_ri)
            s_rf = storage.s_rf.get_tensor(l_rf)

            # Made here: a wgmma TiledMma's runtime state (its accumulate flag) would become kernel parameters.
            mma_s, mma_kv = self._score_mma(), self._kv_mma()
            thr_s = mma_s.get_slice(tidx)
            thr_kv = mma_kv.get_slice(tidx)
            s_shape = thr_s.partition_shape_C((self.tile_m, self.tile_n))
            accs = (cute.make_rmem_tensor(s_shape, cutlass.Float32), cute.make_rmem_tensor(s_shape, cutlass.Float32))
            tau = cute.make_rmem_tensor(s_shape, cutlass.Float32)
            tau_mn = self.rows_cols(tau)
            coord_s = self.rows_cols(thr_s.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
            acc_dq, dq_mn, coord_dq, acc_dkp = self.proxy_gradients(thr_s, thr_kv)
            scale_log2 = scale * LOG2E  # the main scores' (tau)
            proxy_scale_log2 = proxy_scale * LOG2E  # the proxy scores' (pi; proxy_scale also scales dq_p, dk_p)
            rows_per_thread = cute.size(tau_mn, mode=[0])
            cols = cute.size(tau_mn, mode=[1])

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            self.gather_tile(gcopy, q, q_proxy, s_heads, s_qp_all, s_ri, s_rf, lse, lse_proxy, kl_grad, b, p,
                             entry_query, start, n_entries, 0, tidx)
            for tile in cutlass.range(n_tiles, unroll=1):
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                tb = tile % _TILE_BUFFERS
                s_qp = s_qp_all[None, None, tb]
                cute.arch.cp_async_wait_group(0)
                self.publish_async_copies()
                cute.arch.sync_threads()  # this tile's rows and row scalars are in

                # tau_sum = sum_g P_g over the causal keys, S_{g+1} (then S_p) in flight under P_g's exponentials.
                self.gemm(mma_s, thr_s, accs[0], s_heads[None, None, 0], s_k, tidx, False, False, wait=False)
                for g in cutlass.range_constexpr(self.group):
                    if cutlass.const_expr(g + 1 < self.group):
                        self.gemm(mma_s, thr_s, accs[(g + 1) % 2], s_heads[None, None, g + 1], s_k, tidx, False,
                                  False, wait=False)
                    else:
                        self.gemm(mma_s, thr_s, accs[(g + 1) % 2], s_qp, s_kp, tidx, False, False, wait=False)
                    self.wait_products(1)
                    if cutlass.const_expr(g + 1 == self.group):
                        # Every warp's main products are complete: their buffers take the next tile's rows (the
                        # proxy rows and row scalars into the other tile buffer).
                        cute.arch.sync_threads()
                        if tile + 1 < n_tiles:
                            self.gather_tile(gcopy, q, q_proxy, s_heads, s_qp_all, s_ri, s_rf, lse, lse_proxy,
                                             kl_grad, b, p, entry_query, start, n_entries, tile + 1, tidx)
                    s_mn = self.rows_cols(accs[g % 2])
                    for r in cutlass.range_constexpr(rows_per_thread):
                        qi = coord_s[r, 0][0]
                        lse2 = s_rf[qi, tb, g] * LOG2E
                        key_limit = self.visible_limit(s_ri[qi, tb, 0], q_t0)  # -1 past n_q: no key
                        for c in cutlass.range_constexpr(cols):
                            e = cutlass.Float32(0.0)
                            if coord_s[0, c][1] <= key_limit:
                                e = cute.math.exp2(s_mn[r, c] * scale_log2 - lse2, fastmath=True)
                            if cutlass.const_expr(g == 0):
                                tau_mn[r, c] = e
                            else:
                                tau_mn[r, c] += e
                self.wait_products(0)

                # dS_p = (pi - tau) * kl_grad on the tile's distinct queries.
                i_row = s_ri[tidx % self.tile_m, tb, 0]  # this thread's dq_p row, if it reduces one
                sp_mn = self.rows_cols(accs[self.group % 2])
                for r in cutlass.range_constexpr(rows_per_thread):
                    qi = coord_s[r, 0][0]
                    lsep2 = s_rf[qi, tb, self.lse_p_field] * LOG2E
                    cg = s_rf[qi, tb, self.kl_grad_field]
                    key_limit = self.visible_limit(s_ri[qi, tb, 0], q_t0)
                    for c in cutlass.range_constexpr(cols):
                        pi = cutlass.Float32(0.0)
                        if coord_s[0, c][1] <= key_limit:
                            pi = cute.math.exp2(sp_mn[r, c] * proxy_scale_log2 - lsep2, fastmath=True)
                        # Scalar stores: the pairwise stores of store_scores spill here (255 registers).
                        s_ds[qi, coord_s[0, c][1]] = ((pi - tau_mn[r, c] * (1.0 / self.group)) * cg).to(self.dtype)
                self.wait_rows_read(tidx < self.tile_m)  # the previous tile's dq_p rows left s_dq
                self.publish_async_copies()  # dS_p, read next by the MMAs
                cute.arch.sync_threads()

                self.proxy_products(mma_s, thr_s, mma_kv, thr_kv, acc_dq, dq_mn, coord_dq, acc_dkp, s_ds, s_kp, s_qp,
                                    s_dq, proxy_scale, tidx)
                # s_dq is whole; the next tile's dS_p stores and proxy gathers come after every warp's reads.
                cute.arch.sync_threads()
                if tidx < self.tile_m:
                    if tidx < n_q:
                        self.reduce_row(dqp_acc[b, i_row, p, None], s_dq, tidx)
                    cute.arch.cp_async_bulk_commit_group()

            self.flush_block(mma_kv, thr_kv, acc_dkp, dkp_acc[b, None, pkh, None], t0, seqlen, proxy_scale)
            self.wait_rows_done(tidx < self.tile_m)

    @cute.jit
    def gather_tile(self, gcopy, q, q_proxy, s_heads, s_qp_all, s_ri, s_rf, lse, lse_proxy, kl_grad, b, p,
                    entry_query, start, n_entries, tile, tidx):
        """cp.async, as one group, row r of `tile`'s G main head tiles (single buffers) and of its proxy tile (buffer
        tile % 2) from query i_r = entry_query[e0 + r]; the lead thread of a row stages its scalars beside them
        (table buffer tile % 2): the query (a plain store, read after the next barrier), lse_g of each head, lse_p
        and kl_grad. Rows past the tile's queries: zeros, query -1 (no key visible), scalars 0."""
        e0 = start + tile * self.tile_queries
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        tb = tile % _TILE_BUFFERS
        word = cp_async_word(cutlass.Float32)
        thr = gcopy.get_slice(tidx)
        t_c = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        t_sqp = thr.partition_D(s_qp_all[None, None, tb])
        for m in cutlass.range_constexpr(cute.size(t_c, mode=[1])):
            qi = t_c[0, m, 0][0]
            lead = t_c[0, m, 0][1] == 0
            if qi < n_q:
                i = entry_query[e0 + qi]
                for g in cutlass.range_constexpr(self.group):
                    copy_row(gcopy, self.dtype, q[b, i, p * self.group + g, None],
                             thr.partition_D(s_heads[None, None, g]), t_c, m)
                copy_row(gcopy, self.dtype, q_proxy[b, i, p, None], t_sqp, t_c, m)
                if lead:
                    s_ri[qi, tb, 0] = i
                    for g in cutlass.range_constexpr(self.group):
                        copy_word(word, lse[b, p * self.group + g, None], i, s_rf, qi, tb, g)
                    copy_word(word, lse_proxy[b, p, None], i, s_rf, qi, tb, self.lse_p_field)
                    copy_word(word, kl_grad[b, p, None], i, s_rf, qi, tb, self.kl_grad_field)
            else:
                for g in cutlass.range_constexpr(self.group):
                    thr.partition_D(s_heads[None, None, g])[None, m, None].fill(0)
                t_sqp[None, m, None].fill(0)
                if lead:
                    s_ri[qi, tb, 0] = -1
                    for f in cutlass.range_constexpr(self.group + 2):
                        s_rf[qi, tb, f] = 0.0
        cute.arch.cp_async_commit_group()
