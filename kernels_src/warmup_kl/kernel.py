"""Warmup KL pass (CuTeDSL, wgmma, sm90a): query-outer over contiguous tiles, every causal key.

Per CTA: 128 queries of (b, proxy head p); two warpgroups own 64 rows each against every key of a step.
  1. cp.async loads the G main heads' query tiles q[b, m0:m0+128, p*G + g] and the proxy's q_proxy[b, ..., p]
     once (resident: G + 1 tiles of 32 KB), with the first K / K_p tiles of 64 keys (kv head p // (Hp/Hk), proxy
     key head p // (Hp/Hpk)); the next step's K / K_p load while this step runs (two stages);
  2. per key tile: the G + 1 products S_g = Q_g K^T, then S_p = Q_p K_p^T, on wgmma m64n64k16, software
     pipelined: product n + 1 is issued before product n's exponentials run (two accumulators), so the tensor
     cores and the MUFU work overlap inside a warpgroup;
  3. tau_sum = sum_g exp2(s_g scale log2e - lse_g log2e) in registers; then, per row and in log2 units, an online
     log-sum-exp2 of s_p, A += tau_sum (log2 tau_sum - s_p) and T += tau_sum over the causal keys;
  4. at the end: lse_p = ln 2 (max + log2 sum), and KL with tau renormalised by its computed sum T (which is
     G up to rounding): tau^ = tau_sum / T, sum_t tau^ (log2 tau^ - s_p) = A / T - log2 T, so
     KL = ln 2 (A / T - log2 T) + lse_p. The renormalisation is exact math; numerically it cancels the part of
     lse_g's fp32 rounding that every key of a row shares, which at large logits (|lse| in the thousands) is
     the largest error: a relative error e of tau costs e |ln tau - ln pi| in KL.
Only key tiles that reach past the tile's first query are masked (t > i); rows and keys past S are zero-filled
(their P is exactly what the mask or the unstored row makes of it).
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from kernels_src import wgmma
from kernels_src.constants import DTYPES, LN2, LOG2E
from kernels_src.kl_rows import kl_row_sums, scaled_row_max
from kernels_src.tiles import WARPGROUP_ROWS, cp_async_rows, load_rows, smem_tile, tile_storage, wg_acc_rows_cols


class WarmupKL:
    def __init__(self, config):
        self.cfg = config
        self.dtype = DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.group = config.group
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.threads = config.threads
        self.stages = getattr(config, "stages", 2)  # K / K_p stages (the proxy backward stages them its own way)
        if self.tile_m != 2 * WARPGROUP_ROWS or self.threads != 256:
            raise ValueError(f"{type(self).__name__}: tile_m {self.tile_m}, threads {self.threads}; 128 and 256 only")
        self.traced: dict = {}

    def _score_mma(self):
        """Two warpgroups tile M (64 rows each) against all tile_n keys: a row's keys stay in one quad."""
        k_major = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, k_major, k_major, cutlass.Float32,
                                                 (self.tile_m // WARPGROUP_ROWS, 1, 1),
                                                 (WARPGROUP_ROWS, self.tile_n))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, q_proxy: cute.Tensor, k_proxy: cute.Tensor,
                 lse: cute.Tensor, lse_proxy: cute.Tensor, kl_rows: cute.Tensor, scale: cutlass.Float32,
                 proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32,
                 stream: cuda.CUstream):
        l_q = smem_tile(self.dtype, (self.tile_m, self.head_dim, self.group + 1))
        l_k = smem_tile(self.dtype, (self.tile_n, self.head_dim, self.stages))

        @cute.struct
        class SharedStorage:
            s_q: tile_storage(self.dtype, l_q)
            s_k: tile_storage(self.dtype, l_k)
            s_kp: tile_storage(self.dtype, l_k)

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel(q, k, q_proxy, k_proxy, lse, lse_proxy, kl_rows, scale, proxy_scale, hp_per_hk, hp_per_hpk,
                    l_q, l_k,
                    cp_async_rows(self.dtype, self.head_dim, self.threads), SharedStorage).launch(
            grid=(cute.ceil_div(q.shape[1], self.tile_m), q_proxy.shape[2], q.shape[0]),
            block=(self.threads, 1, 1), smem=self.traced["smem_bytes"], stream=stream)

    @cute.kernel
    def kernel(self, q, k, q_proxy, k_proxy, lse, lse_proxy, kl_rows, scale: cutlass.Float32,
               proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32,
               l_q: cute.ComposedLayout,
               l_k: cute.ComposedLayout, gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        b, p, m0, seqlen, n_steps, first_masked, kv, pk = self.query_tile(q, hp_per_hk, hp_per_hpk)

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(l_q.outer, swizzle=l_q.inner)
        s_k = storage.s_k.get_tensor(l_k.outer, swizzle=l_k.inner)
        s_kp = storage.s_kp.get_tensor(l_k.outer, swizzle=l_k.inner)

        for g in cutlass.range_constexpr(self.group):
            load_rows(gcopy, self.dtype, q[b, None, p * self.group + g, None], s_q[None, None, g], m0, seqlen, tidx)
        load_rows(gcopy, self.dtype, q_proxy[b, None, p, None], s_q[None, None, self.group], m0, seqlen, tidx)
        self.load_keys(gcopy, k, k_proxy, s_k, s_kp, b, kv, pk, 0, seqlen, tidx)

        thr, accs, tau, tau_mn, coord = self.score_accumulators(tidx)
        rows = cute.size(tau_mn, mode=[0])
        scale_log2 = scale * LOG2E  # the main scores' (tau)
        proxy_scale_log2 = proxy_scale * LOG2E  # the proxy scores'

        # Per row: lse_g in log2 units (rows past S: +inf, so their P is 0), and the running statistics.
        lse2 = cute.make_rmem_tensor((rows, self.group), cutlass.Float32)
        row_max = cute.make_rmem_tensor((rows,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((rows,), cutlass.Float32)
        a_sum = cute.make_rmem_tensor((rows,), cutlass.Float32)
        t_sum = cute.make_rmem_tensor((rows,), cutlass.Float32)
        for r in cutlass.range_constexpr(rows):
            i = m0 + coord[r, 0][0]
            for g in cutlass.range_constexpr(self.group):
                lse2[r, g] = cutlass.Float32.inf
                if i < seqlen:
                    lse2[r, g] = lse[b, p * self.group + g, i] * LOG2E
            row_max[r] = -cutlass.Float32.inf
            row_sum[r] = 0.0
            a_sum[r] = 0.0
            t_sum[r] = 0.0

        for step in cutlass.range(n_steps, unroll=1):
            if step + 1 < n_steps:
                self.load_keys(gcopy, k, k_proxy, s_k, s_kp, b, kv, pk, step + 1, seqlen, tidx)
            else:
                cute.arch.cp_async_commit_group()  # keeps the group count: wait_group(1) below
            cute.arch.cp_async_wait_group(1)
            cute.arch.fence_view_async_shared()  # cp.async writes -> wgmma's async-proxy reads
            cute.arch.sync_threads()

            stage = step % self.stages
            t0 = step * self.tile_n
            # Products n = 0 .. G - 1: S_g = Q_g K^T; n = G: S_p = Q_p K_p^T. Product n + 1 runs while product
            # n's exponentials do.
            self.issue(accs[0], s_q[None, None, 0], s_k[None, None, stage], tidx)
            for n in cutlass.range_constexpr(self.group + 1):
                if cutlass.const_expr(n + 1 < self.group):
                    self.issue(accs[(n + 1) % 2], s_q[None, None, n + 1], s_k[None, None, stage], tidx)
                elif cutlass.const_expr(n + 1 == self.group):
                    self.issue(accs[(n + 1) % 2], s_q[None, None, self.group], s_kp[None, None, stage], tidx)
                warpgroup.wait_group(1 if n < self.group else 0)
                s_mn = wg_acc_rows_cols(accs[n % 2])
                if cutlass.const_expr(n < self.group):
                    self.accumulate_tau(s_mn, tau_mn, lse2, n, scale_log2)
                else:
                    # Two copies: tiles below the diagonal (most of them) skip the causal mask's compares.
                    if step >= first_masked:
                        self.proxy_row_stats(s_mn, tau_mn, coord, row_max, row_sum, a_sum, t_sum, m0, t0,
                                             proxy_scale_log2,
                                             True)
                    else:
                        self.proxy_row_stats(s_mn, tau_mn, coord, row_max, row_sum, a_sum, t_sum, m0, t0,
                                             proxy_scale_log2,
                                             False)
            # Every warp is past its reads of this stage before the load two steps on overwrites it.
            cute.arch.sync_threads()

        self.write_rows(row_max, row_sum, a_sum, t_sum, coord, lse_proxy, kl_rows, b, p, m0, seqlen, tidx)

    @cute.jit
    def write_rows(self, row_max, row_sum, a_sum, t_sum, coord, lse_proxy, kl_rows, b, p, m0, seqlen, tidx):
        """Each row's statistics summed over its quad, then lse_p and KL written once (rows past S are not)."""
        quad_lane = tidx % 4
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            s, a, t = row_sum[r], a_sum[r], t_sum[r]
            for off in cutlass.range_constexpr(2):
                s += cute.arch.shuffle_sync_bfly(s, offset=2 >> off)
                a += cute.arch.shuffle_sync_bfly(a, offset=2 >> off)
                t += cute.arch.shuffle_sync_bfly(t, offset=2 >> off)
            i = m0 + coord[r, 0][0]
            if i < seqlen and quad_lane == 0:
                lse_p = (row_max[r] + cute.math.log2(s, fastmath=True)) * LN2
                kl = cutlass.Float32(0.0)
                if t != 0.0:  # unordered: a NaN tau (NaN in q or k) makes the KL NaN, not 0
                    kl = (a * cute.arch.rcp_approx(t) - cute.math.log2(t, fastmath=True)) * LN2 + lse_p
                lse_proxy[b, p, i] = lse_p
                kl_rows[b, p, i] = kl

    def query_tile(self, q, hp_per_hk, hp_per_hpk):
        """Trace time: this CTA's batch b, proxy head p, first query m0, key steps, first masked step (key tiles
        from there hold keys t > m0, the tile's first query) and its kv / proxy-key heads. Causal work grows with
        the tile index: the longest tiles go first so they do not form the tail."""
        tile_rev, p, b = cute.arch.block_idx()
        n_qtiles, _, _ = cute.arch.grid_dim()
        m0 = (n_qtiles - 1 - tile_rev) * self.tile_m
        seqlen = q.shape[1]
        n_steps = (cutlass.min(m0 + self.tile_m, seqlen) - 1) // self.tile_n + 1
        return b, p, m0, seqlen, n_steps, m0 // self.tile_n, p // hp_per_hk, p // hp_per_hpk

    def score_accumulators(self, tidx):
        """Trace time: this thread's slice of the score MMA, the two product accumulators, tau_sum's accumulator
        and its rows x columns view, and the (row, key) coordinates."""
        thr = self._score_mma().get_slice(tidx)
        acc_shape = thr.partition_shape_C((self.tile_m, self.tile_n))
        accs = (cute.make_rmem_tensor(acc_shape, cutlass.Float32), cute.make_rmem_tensor(acc_shape, cutlass.Float32))
        tau = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        coord = wg_acc_rows_cols(thr.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        return thr, accs, tau, wg_acc_rows_cols(tau), coord

    @cute.jit
    def load_keys(self, gcopy, k, k_proxy, s_k, s_kp, b, kv, pk, step, seqlen, tidx):
        """cp.async key tile `step` of K and K_p into stage step % stages, as one group (rows past S: zeros)."""
        stage = step % self.stages
        t0 = step * self.tile_n
        load_rows(gcopy, self.dtype, k[b, None, kv, None], s_k[None, None, stage], t0, seqlen, tidx)
        load_rows(gcopy, self.dtype, k_proxy[b, None, pk, None], s_kp[None, None, stage], t0, seqlen, tidx)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def issue(self, acc, s_a, s_b, tidx):
        """acc = A B^T (fp32, unscaled) issued as one wgmma commit group, not waited for. The MMA is made here: its
        accumulate flag is per-step state that must not outlive this call."""
        wgmma.issue_smem(self._score_mma(), tidx, acc, s_a, s_b)

    @cute.jit
    def accumulate_tau(self, s_mn, tau_mn, lse2, g: cutlass.Constexpr, scale_log2):
        """tau_sum (=, at g = 0, else +=) exp2(s_g scale log2e - lse_g log2e); causal masking comes later, once."""
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                e = cute.math.exp2(s_mn[r, c] * scale_log2 - lse2[r, g], fastmath=True)
                if cutlass.const_expr(g == 0):
                    tau_mn[r, c] = e
                else:
                    tau_mn[r, c] += e

    @cute.jit
    def proxy_row_stats(self, s_mn, tau_mn, coord, row_max, row_sum, a_sum, t_sum, m0, t0, scale_log2,
                        masked: cutlass.Constexpr):
        """Fold this key tile's proxy scores and tau_sum into each row's running (max, sum) of exp2(s_p) and its
        A, T sums (log2 units). In masked tiles keys t > i drop out of all of them."""
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            key_limit = m0 + coord[r, 0][0] - t0
            tile_max = scaled_row_max(s_mn, tau_mn, coord, r, key_limit, scale_log2, masked)
            # Every row sees key 0 at step 0 (rows past S see every key), so new_max is finite from there on.
            new_max = cute.arch.fmax(row_max[r], tile_max)
            part, a, t = kl_row_sums(s_mn, tau_mn, coord, r, key_limit, new_max, masked)
            row_sum[r] = row_sum[r] * cute.math.exp2(row_max[r] - new_max, fastmath=True) + part
            row_max[r] = new_max
            a_sum[r] += a
            t_sum[r] += t
