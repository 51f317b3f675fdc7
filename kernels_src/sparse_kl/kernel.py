"""MSA KL pass (CuTeDSL): each (query, slot)'s share of the true KL and of the proxy lse, on the proxy
backward's tiles.

KL_p(i) = sum_t tau (ln tau - ln pi) with ln pi = s_p - lse_p and sum_t tau = 1 over the selected set, so
KL = sum_t tau (ln tau - s_p) + lse_p * sum_t tau: each part adds over keys, and lse_p is needed only at the end.
Per tile of 64 distinct queries and this CTA's 64 keys of the slot's block: tau_sum = sum over the G heads of
P_h = exp(s_h - lse_h) (the proxy backward's head loop), then, from the proxy row, per (query, warp of keys)
A = sum tau (log2 tau - s_p log2 e), T = sum tau and L = the log2-sum-exp2 of s_p log2 e over the causal keys,
written to kl_part[entry, key slice, key warp, 0:3] (each written once: no atomics, deterministic). The runtime
merges L into the proxy lse and forms KL = ln 2 * sum A + lse_p * sum T.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.constants import LOG2E
from kernels_src.sparse_bwd_proxy.kernel import SparseProxyBackward
from kernels_src.tiles import copy_row, tile_storage
from kernels_src.work_items import keys_in_query_rows


class SparseKL(SparseProxyBackward):
    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, q_proxy: cute.Tensor, k_proxy: cute.Tensor,
                 entry_query: cute.Tensor, entry_dest: cute.Tensor, items: cute.Tensor, lse: cute.Tensor,
                 kl_part: cute.Tensor, scale: cutlass.Float32, proxy_scale: cutlass.Float32,
                 hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32, stream: cuda.CUstream):
        l_kv = self._smem_layout((self.tile_n, self.head_dim))
        l_rows = self._smem_layout((self.tile_m, self.head_dim, self.stages))

        @cute.struct
        class SharedStorage:
            s_k: tile_storage(self.dtype, l_kv)
            s_kp: tile_storage(self.dtype, l_kv)
            s_q: tile_storage(self.dtype, l_rows)
            s_qp: tile_storage(self.dtype, l_rows)

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_kl(q, k, q_proxy, k_proxy, entry_query, entry_dest, items, lse, kl_part, scale, proxy_scale,
                       hp_per_hk, hp_per_hpk, l_kv, l_rows, self._gmem_copy(), SharedStorage).launch(
            grid=(items.shape[0] * self.halves, 1, 1), block=(self.threads, 1, 1), smem=self.traced["smem_bytes"],
            stream=stream)

    @cute.kernel
    def kernel_kl(self, q, k, q_proxy, k_proxy, entry_query, entry_dest, items, lse, kl_part,
                  scale: cutlass.Float32, proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32,
                  hp_per_hpk: cutlass.Int32, l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout,
                  gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        w = cta // self.halves
        n_entries = items[w, 3]
        if n_entries > 0:
            bp, j, start = items[w, 0], items[w, 1], items[w, 2]
            hp = q_proxy.shape[2]
            b = bp // hp
            p = bp - b * hp
            half = cta - w * self.halves
            t0 = j * self.block_size + half * self.tile_n
            seqlen, q_t0 = keys_in_query_rows(t0, q, k)
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_k = storage.s_k.get_tensor(l_kv.outer, swizzle=l_kv.inner)
            s_kp = storage.s_kp.get_tensor(l_kv.outer, swizzle=l_kv.inner)
            s_q_all = storage.s_q.get_tensor(l_rows.outer, swizzle=l_rows.inner)
            s_qp_all = storage.s_qp.get_tensor(l_rows.outer, swizzle=l_rows.inner)
            self.load_block(gcopy, k[b, None, p // hp_per_hk, None], s_k, t0, seqlen, tidx)
            self.load_block(gcopy, k_proxy[b, None, p // hp_per_hpk, None], s_kp, t0, seqlen, tidx)

            mma_s = self._score_mma()  # made here: a wgmma TiledMma's runtime state would become kernel parameters
            thr_s = mma_s.get_slice(tidx)
            acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32)
            tau = cute.make_rmem_tensor(thr_s.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32)
            s_mn, tau_mn = self.rows_cols(acc_s), self.rows_cols(tau)
            coord_s = self.rows_cols(thr_s.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
            scale_log2 = scale * LOG2E  # the main scores' (tau)
            proxy_scale_log2 = proxy_scale * LOG2E  # the proxy scores' (pi, lse_p, the KL's A)
            log2_g = math.log2(self.group)
            rows_per_thread = cute.size(s_mn, mode=[0])
            quad_lane = tidx % 4
            warp_n = tidx // 128

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            n_steps = n_tiles * self.group
            self.gather_step(gcopy, q, q_proxy, s_q_all, s_qp_all, b, p, entry_query, start, n_entries, 0, tidx)
            for step in cutlass.range(n_steps, unroll=1):
                tile = step // self.group
                g = step - tile * self.group
                e0 = start + tile * self.tile_queries
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                if cutlass.const_expr(self.stages == 1):
                    cute.arch.cp_async_wait_group(0)  # this step's rows, gathered after the previous step's barrier
                else:
                    if step + 1 < n_steps:
                        self.gather_step(gcopy, q, q_proxy, s_q_all, s_qp_all, b, p, entry_query, start, n_entries,
                                         step + 1, tidx)
                    else:
                        cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(1)
                self.publish_async_copies()
                cute.arch.sync_threads()

                if g == 0:
                    tau.fill(0.0)
                self.accumulate_tau(mma_s, thr_s, acc_s, s_mn, tau_mn, coord_s, s_q_all[None, None, step % self.stages],
                                    s_k, lse, b, p * self.group + g, entry_query, e0, n_q, q_t0, scale_log2, tidx)

                if g == self.group - 1:
                    # Per (query, this warp's keys of the slice), in log2 units: A = sum tau (log2 tau - s_p), T =
                    # sum tau, and L = log2-sum-exp2 of s_p, each over the causal keys. No lse_p is needed here:
                    # KL = ln 2 * sum A + lse_p * sum T once the runtime has merged L into lse_p.
                    self.gemm(mma_s, thr_s, acc_s, s_qp_all[None, None, tile % self.stages], s_kp, tidx, False, False)
                    for r in cutlass.range_constexpr(rows_per_thread):
                        qi = coord_s[r, 0][0]
                        key_limit = -1
                        if qi < n_q:
                            key_limit = entry_query[e0 + qi] - q_t0
                        row_max = -cutlass.Float32.inf
                        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                            if coord_s[0, c][1] <= key_limit:
                                row_max = cute.arch.fmax(row_max, s_mn[r, c] * proxy_scale_log2)
                        row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
                        row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=1))
                        sum_exp = cutlass.Float32(0.0)
                        a_sum = cutlass.Float32(0.0)
                        t_sum = cutlass.Float32(0.0)
                        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                            if coord_s[0, c][1] <= key_limit:
                                sp2 = s_mn[r, c] * proxy_scale_log2
                                sum_exp += cute.math.exp2(sp2 - row_max, fastmath=True)
                                ts = tau_mn[r, c]
                                if ts != 0.0:
                                    # tau_sum >= FLT_MIN here (exp2.ftz never returns a denormal), whereas
                                    # tau_sum / G could be denormal and flush to zero in lg2.ftz. `!=` is
                                    # unordered: a NaN tau (NaN in q or k) reaches A and T.
                                    a_sum += ts * (cute.math.log2(ts, fastmath=True) - log2_g - sp2)
                                    t_sum += ts
                        for off in cutlass.range_constexpr(2):
                            sum_exp += cute.arch.shuffle_sync_bfly(sum_exp, offset=2 >> off)
                            a_sum += cute.arch.shuffle_sync_bfly(a_sum, offset=2 >> off)
                            t_sum += cute.arch.shuffle_sync_bfly(t_sum, offset=2 >> off)
                        if qi < n_q and quad_lane == 0:
                            lse2 = -cutlass.Float32.inf
                            if sum_exp != 0.0:  # unordered: NaN (a NaN proxy score) stays NaN
                                lse2 = row_max + cute.math.log2(sum_exp, fastmath=True)
                            # Key group = (slice, key half): warps (4, 2) over (queries, keys), column-major,
                            # hold key half w // 4 = tidx // 128, as the wgmma kernel's warpgroups do.
                            dest = cutlass.Int64(entry_dest[e0 + qi])
                            col = (half * 2 + warp_n) * 3
                            kl_part[dest, col] = a_sum * (1.0 / self.group)
                            kl_part[dest, col + 1] = t_sum * (1.0 / self.group)
                            kl_part[dest, col + 2] = lse2
                # The next steps' gathers overwrite what this step read.
                cute.arch.sync_threads()
                if cutlass.const_expr(self.stages == 1):
                    # One buffer (D 256): the next step's rows only now (a step ahead they would overwrite this
                    # step's before every warp had read them).
                    if step + 1 < n_steps:
                        self.gather_step(gcopy, q, q_proxy, s_q_all, s_qp_all, b, p, entry_query, start, n_entries,
                                         step + 1, tidx)

    @cute.jit
    def accumulate_tau(self, mma_s, thr_s, acc_s, s_mn, tau_mn, coord_s, s_q, s_k, lse, b, h, entry_query, e0, n_q, t0,
                       scale_log2, tidx):
        """tau_sum += exp(s_h - lse_h) over the tile's queries and this CTA's keys (causal; rows past n_q: 0). The
        KL pass reads each row's query and lse_h from global memory after the product: staging them with the
        gathers, as the proxy backward does, measured 5 % slower here ((b) 64K: 18.7 -> 19.5 ms; its two CTAs per
        SM hide the loads' latency, and the staging costs registers it needs to stay at two)."""
        self.gemm(mma_s, thr_s, acc_s, s_q, s_k, tidx, False, False)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            qi = coord_s[r, 0][0]
            lse2 = cutlass.Float32(0.0)
            key_limit = -1
            if qi < n_q:
                i = entry_query[e0 + qi]
                lse2 = lse[b, h, i] * LOG2E
                key_limit = i - t0
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if coord_s[0, c][1] <= key_limit:
                    tau_mn[r, c] += cute.math.exp2(s_mn[r, c] * scale_log2 - lse2, fastmath=True)

    @cute.jit
    def gather_step(self, gcopy, q, q_proxy, s_q_all, s_qp_all, b, p, entry_query, start, n_entries, step, tidx):
        """cp.async, as one group, row r <- q[b, i_r, p*G + g] (i_r = entry_query[e0 + r]) for step = tile*G + g into
        q buffer step % stages and, at g = 0, row r <- q_proxy[b, i_r, p] into proxy buffer tile % stages. Rows past
        the tile's queries are zero-filled."""
        tile = step // self.group
        g = step - tile * self.group
        e0 = start + tile * self.tile_queries
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        thr = gcopy.get_slice(tidx)
        t_c = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        t_sq = thr.partition_D(s_q_all[None, None, step % self.stages])
        t_sqp = thr.partition_D(s_qp_all[None, None, tile % self.stages])
        for m in cutlass.range_constexpr(cute.size(t_sq, mode=[1])):
            qi = t_c[0, m, 0][0]
            if qi < n_q:
                i = entry_query[e0 + qi]
                copy_row(gcopy, self.dtype, q[b, i, p * self.group + g, None], t_sq, t_c, m)
                if g == 0:
                    copy_row(gcopy, self.dtype, q_proxy[b, i, p, None], t_sqp, t_c, m)
            else:
                t_sq[None, m, None].fill(0)
                if g == 0:
                    t_sqp[None, m, None].fill(0)
        cute.arch.cp_async_commit_group()
