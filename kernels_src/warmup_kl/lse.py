"""Warmup proxy lse (sm90a, warp-specialised): lse_p(i) = logsumexp over t <= i of the proxy's scores, nothing else.

Deferred KL mode needs the proxy lse before the proxy backward (pi = exp(s_p - lse_p)) but not the KL value
before it: the backward's kl_value variant (kernels_src/warmup_bwd_proxy) forms the value from the tau and pi it
computes anyway. So the KL pass's G main products per key tile, the tau exponentials and the log2 per element
drop out, and what is left is the proxy's product and an online log-sum-exp2: 2 Dp FLOPs and one exponential
per (query, key) pair instead of 2 D (G + 1) and G + 2 (at (b), G = 4: ~1 / 5 of the KL pass's products and
~1 / 6 of its MUFU work).
The ping-pong kernel (pingpong.py) with one resident query tile (q_proxy's) and one key ring (k_proxy's): the
producer warp streams K_p tiles, the consumer warpgroups take turns at the product. The row statistics are the
KL pass's (kernels_src.kl_rows.scaled_row_max and the same online update, over the same tiles in the same order),
so lse_p is the KL pass's bit for bit.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from kernels_src.barriers import WarmupKLPingPong as Bar
from kernels_src.constants import LN2, LOG2E
from kernels_src.kl_rows import lse_row_part, scaled_row_max
from kernels_src.tiles import cp_async_rows, load_rows, smem_tile, tile_storage, wg_acc_rows_cols
from kernels_src.warmup_kl.pingpong import CONSUMERS, WarmupKLPingPong


class WarmupProxyLse(WarmupKLPingPong):
    @cute.jit
    def __call__(self, q_proxy: cute.Tensor, k_proxy: cute.Tensor, lse_proxy: cute.Tensor,
                 proxy_scale: cutlass.Float32, hp_per_hpk: cutlass.Int32, stream):
        l_q = smem_tile(self.dtype, (self.tile_m, self.head_dim, 1))
        l_k = smem_tile(self.dtype, (self.tile_n, self.head_dim, self.stages))

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[cutlass.Int64, self.stages]
            empty: cute.struct.MemRange[cutlass.Int64, self.stages]
            s_q: tile_storage(self.dtype, l_q)
            s_kp: tile_storage(self.dtype, l_k)

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_lse(q_proxy, k_proxy, lse_proxy, proxy_scale, hp_per_hpk, l_q, l_k,
                        cp_async_rows(self.dtype, self.head_dim, CONSUMERS, self.ROW_THREADS),
                        cp_async_rows(self.dtype, self.head_dim, 32, self.ROW_THREADS), SharedStorage).launch(
            grid=(cute.ceil_div(q_proxy.shape[1], self.tile_m), q_proxy.shape[2], q_proxy.shape[0]),
            block=(self.block_threads, 1, 1), smem=self.traced["smem_bytes"], stream=stream)

    @cute.kernel
    def kernel_lse(self, q_proxy, k_proxy, lse_proxy, proxy_scale: cutlass.Float32, hp_per_hpk: cutlass.Int32,
                   l_q: cute.ComposedLayout, l_k: cute.ComposedLayout, gcopy: cute.TiledCopy,
                   gcopy_warp: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        b, p, m0, seqlen, n_steps, first_masked, _, pk = self.query_tile(q_proxy, hp_per_hpk, hp_per_hpk)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        s_q = storage.s_q.get_tensor(l_q.outer, swizzle=l_q.inner)
        s_kp = storage.s_kp.get_tensor(l_k.outer, swizzle=l_k.inner)
        self.init_ring(full, empty, tidx)

        if warp == CONSUMERS // 32:
            self.produce(gcopy_warp, ((k_proxy[b, None, pk, None], s_kp),), full, empty, n_steps, seqlen,
                         tidx - CONSUMERS)
        else:
            self.consume_lse(q_proxy, lse_proxy, proxy_scale, s_q, s_kp, full, empty, gcopy, b, p, m0, seqlen, n_steps,
                             first_masked, tidx)

    @cute.jit
    def consume_lse(self, q_proxy, lse_proxy, proxy_scale, s_q, s_kp, full, empty, gcopy, b, p, m0, seqlen, n_steps,
                    first_masked, tidx):
        wg = tidx // 128
        load_rows(gcopy, self.dtype, q_proxy[b, None, p, None], s_q[None, None, 0], m0, seqlen, tidx)
        cute.arch.cp_async_commit_group()

        thr, accs, tau, tau_mn, coord = self.score_accumulators(tidx)
        rows = cute.size(tau_mn, mode=[0])
        scale_log2 = proxy_scale * LOG2E
        row_max = cute.make_rmem_tensor((rows,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((rows,), cutlass.Float32)
        for r in cutlass.range_constexpr(rows):
            row_max[r] = -cutlass.Float32.inf
            row_sum[r] = 0.0

        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=Bar.QUERIES, number_of_threads=CONSUMERS)
        if wg == 1:
            cute.arch.barrier_arrive(barrier_id=Bar.TURN, number_of_threads=CONSUMERS)

        for step in cutlass.range(n_steps, unroll=1):
            stage = step % self.stages
            t0 = step * self.tile_n
            cute.arch.mbarrier_wait(full + stage, (step // self.stages) % 2)
            cute.arch.fence_view_async_shared()

            cute.arch.barrier(barrier_id=Bar.TURN + wg, number_of_threads=CONSUMERS)
            self.issue(accs[0], s_q[None, None, 0], s_kp[None, None, stage], tidx)
            cute.arch.barrier_arrive(barrier_id=Bar.TURN + 1 - wg, number_of_threads=CONSUMERS)
            warpgroup.wait_group(0)
            if tidx % 32 == 0:
                cute.arch.mbarrier_arrive(empty + stage)
            s_mn = wg_acc_rows_cols(accs[0])
            if step >= first_masked:
                self.proxy_row_lse(s_mn, tau_mn, coord, row_max, row_sum, m0, t0, scale_log2, True)
            else:
                self.proxy_row_lse(s_mn, tau_mn, coord, row_max, row_sum, m0, t0, scale_log2, False)
        if wg == 0:
            cute.arch.barrier(barrier_id=Bar.TURN, number_of_threads=CONSUMERS)

        for r in cutlass.range_constexpr(rows):
            s = row_sum[r]
            for off in cutlass.range_constexpr(2):
                s += cute.arch.shuffle_sync_bfly(s, offset=2 >> off)
            i = m0 + coord[r, 0][0]
            if i < seqlen and tidx % 4 == 0:
                lse_proxy[b, p, i] = (row_max[r] + cute.math.log2(s, fastmath=True)) * LN2

    @cute.jit
    def proxy_row_lse(self, s_mn, tau_mn, coord, row_max, row_sum, m0, t0, scale_log2, masked: cutlass.Constexpr):
        """proxy_row_stats' running (max, sum) of exp2(s_p) alone (tau_mn: scratch that scaled_row_max's mask
        writes, never read)."""
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            key_limit = m0 + coord[r, 0][0] - t0
            tile_max = scaled_row_max(s_mn, tau_mn, coord, r, key_limit, scale_log2, masked)
            new_max = cute.arch.fmax(row_max[r], tile_max)
            part = lse_row_part(s_mn, coord, r, key_limit, new_max, masked)
            row_sum[r] = row_sum[r] * cute.math.exp2(row_max[r] - new_max, fastmath=True) + part
            row_max[r] = new_max
