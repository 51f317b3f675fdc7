"""Warmup proxy backward (CuTeDSL, wgmma, sm90a): query-outer over contiguous tiles, every causal key.

Per CTA: 128 queries of (b, proxy head p), two warpgroups x 64 rows, as the warmup KL pass (kernels_src.warmup_kl,
whose score products, pipelining and tau accumulation this kernel inherits). Per key tile of 64 keys:
  1. S_g = Q_g K^T for the G heads (tau_sum += exp2(s_g - lse_g)), then S_p = Q_p K_p^T, pipelined;
  2. dS_p = (exp2(s_p - lse_p) - tau_sum / G) * kl_grad per (row, key), 0 past the causal limit;
  3. dq_p += dS_p K_p: dS_p from registers (bf16, the score accumulator's registers as the A operand), K_p^T by
     descriptor; the accumulator stays in registers across the key loop and is added once, times scale, to the
     fp32 dq_p rows;
  4. dS_p is stored to shared memory (bf16) and, after a barrier, dk_p(tile) = dS_p^T Q_p over the 128 queries
     (warpgroup w: head-dim columns [64 w, 64 w + 64)), added times scale to the fp32 dk_p rows with vector
     atomics (every query tile of (b, pk) meets there).
kl_value = 1 (deferred KL mode, one launch per group): each row also sums A = sum tau (log2 tau - s_p) and
T = sum tau from the tau and s_p of step 2, as the KL pass does (kernels_src.kl_rows), and writes
KL = ln 2 (A / T - log2 T) + lse_p once per row: the KL value without the KL pass's second walk over the keys.
Shared memory (G = 4: 224 KB): the G + 1 resident query tiles, two K_p tiles (K_p for tile + 1 loads while tile
runs), one K tile (tile + 1's K loads once the barrier before dk_p has seen every main product of the tile read
it), and the dS_p tile. Two barriers per key tile.
A proxy group of more heads than the variant's G (8, 16 with G = 4) runs as several launches over consecutive
chunks of G heads (group_heads, head0): dS_p is linear in tau, so the chunks' gradients add up exactly; each
launch recomputes the proxy's products.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from kernels_src import wgmma
from kernels_src.atomics import red_add_v2
from kernels_src.constants import FLT_MIN, LN2, LOG2E
from kernels_src.tiles import (WARPGROUP_ROWS, cp_async_rows, load_rows, smem_tile, tile_storage, transposed,
                               wg_acc_as_a, wg_acc_rows_cols)
from kernels_src.warmup_kl.kernel import WarmupKL

_K, _MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN


class RowView:
    """lse2[r, g] for accumulate_tau: row r of this thread's accumulator rows, read from the staged row table."""

    def __init__(self, s_rows, coord):
        self.s_rows, self.coord = s_rows, coord

    def __getitem__(self, rg):
        return self.s_rows[self.coord[rg[0], 0][0], rg[1]]


class WarmupProxyBackward(WarmupKL):
    def __init__(self, config):
        super().__init__(config)
        self.kl_value = bool(getattr(config, "kl_value", 0))

    def _dq_mma(self):
        """dq_p += dS_p K_p: rows as the score products (two warpgroups tile M), A from registers."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, _K, _MN, cutlass.Float32,
                                                 (self.tile_m // WARPGROUP_ROWS, 1, 1),
                                                 (WARPGROUP_ROWS, self.head_dim), a_source=warpgroup.OperandSource.RMEM)

    def _dk_mma(self):
        """dk_p = dS_p^T Q_p: the tile's 64 keys as M, the two warpgroups split the head dim."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, _MN, _MN, cutlass.Float32, (1, 2, 1),
                                                 (WARPGROUP_ROWS, self.head_dim // 2))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, q_proxy: cute.Tensor, k_proxy: cute.Tensor,
                 lse: cute.Tensor, lse_proxy: cute.Tensor, kl_grad: cute.Tensor, dqp_acc: cute.Tensor,
                 dkp_acc: cute.Tensor, kl_rows: cute.Tensor, scale: cutlass.Float32, proxy_scale: cutlass.Float32,
                 hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32,
                 group_heads: cutlass.Int32, head0: cutlass.Int32, stream: cuda.CUstream):
        l_q = smem_tile(self.dtype, (self.tile_m, self.head_dim, self.group + 1))
        l_k = smem_tile(self.dtype, (self.tile_n, self.head_dim))
        l_kp = smem_tile(self.dtype, (self.tile_n, self.head_dim, 2))
        l_ds = smem_tile(self.dtype, (self.tile_m, self.tile_n))

        @cute.struct
        class SharedStorage:
            s_q: tile_storage(self.dtype, l_q)
            s_k: tile_storage(self.dtype, l_k)
            s_kp: tile_storage(self.dtype, l_kp)
            s_ds: tile_storage(self.dtype, l_ds)
            s_rows: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, self.tile_m * (self.group + 2)], 16]

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_bwd(q, k, q_proxy, k_proxy, lse, lse_proxy, kl_grad, dqp_acc, dkp_acc, kl_rows, scale,
                        proxy_scale, hp_per_hk, hp_per_hpk, group_heads, head0, l_q, l_k, l_kp, l_ds,
                        cp_async_rows(self.dtype, self.head_dim, self.threads), SharedStorage).launch(
            grid=(cute.ceil_div(q.shape[1], self.tile_m), q_proxy.shape[2], q.shape[0]),
            block=(self.threads, 1, 1), smem=self.traced["smem_bytes"], stream=stream)

    @cute.kernel
    def kernel_bwd(self, q, k, q_proxy, k_proxy, lse, lse_proxy, kl_grad, dqp_acc, dkp_acc, kl_rows,
                   scale: cutlass.Float32, proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32,
                   hp_per_hpk: cutlass.Int32, group_heads: cutlass.Int32, head0: cutlass.Int32,
                   l_q: cute.ComposedLayout, l_k: cute.ComposedLayout, l_kp: cute.ComposedLayout,
                   l_ds: cute.ComposedLayout, gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        b, p, m0, seqlen, n_steps, first_masked, kv, pk = self.query_tile(q, hp_per_hk, hp_per_hpk)
        h0 = p * group_heads + head0  # this launch's first main head: the group's heads [h0, h0 + G)
        # dS_p = (pi - tau) kl_grad with tau = (1 / group_heads) sum_g P_g is linear in tau: a group of
        # group_heads = n * G heads runs as n launches over G heads each, every launch adding
        # ((G / group_heads) pi - (1 / group_heads) sum of its P_g) kl_grad.
        pi_weight = cutlass.Float32(self.group) / cutlass.Float32(group_heads)
        tau_weight = cutlass.Float32(1.0) / cutlass.Float32(group_heads)

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_q = storage.s_q.get_tensor(l_q.outer, swizzle=l_q.inner)
        s_k = storage.s_k.get_tensor(l_k.outer, swizzle=l_k.inner)
        s_kp = storage.s_kp.get_tensor(l_kp.outer, swizzle=l_kp.inner)
        s_ds = storage.s_ds.get_tensor(l_ds.outer, swizzle=l_ds.inner)

        for g in cutlass.range_constexpr(self.group):
            load_rows(gcopy, self.dtype, q[b, None, h0 + g, None], s_q[None, None, g], m0, seqlen, tidx)
        load_rows(gcopy, self.dtype, q_proxy[b, None, p, None], s_q[None, None, self.group], m0, seqlen, tidx)
        load_rows(gcopy, self.dtype, k[b, None, kv, None], s_k, 0, seqlen, tidx)
        load_rows(gcopy, self.dtype, k_proxy[b, None, pk, None], s_kp[None, None, 0], 0, seqlen, tidx)
        cute.arch.cp_async_commit_group()

        thr, accs, tau, tau_mn, coord = self.score_accumulators(tidx)
        rows = cute.size(tau_mn, mode=[0])
        thr_dq = self._dq_mma().get_slice(tidx)
        acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((self.tile_m, self.head_dim)), cutlass.Float32)
        acc_dq.fill(0.0)
        thr_dk = self._dk_mma().get_slice(tidx)
        acc_dk = cute.make_rmem_tensor(thr_dk.partition_shape_C((self.tile_n, self.head_dim)), cutlass.Float32)
        coord_dk = wg_acc_rows_cols(thr_dk.partition_C(cute.make_identity_tensor((self.tile_n, self.head_dim))))
        t_ds = thr.partition_C(s_ds)  # this thread's (row, key) elements of the dS_p tile
        scale_log2 = scale * LOG2E  # the main scores' (tau)
        proxy_scale_log2 = proxy_scale * LOG2E  # the proxy scores' (pi, the KL's A, dS_p's chain factor)

        # Per row: lse_g and lse_p in log2 units and kl_grad, staged once in shared memory (registers are what
        # G = 4 runs out of). Rows past S: P = pi = 0 (+inf lse), kl_grad 0.
        s_rows = storage.s_rows.get_tensor(cute.make_layout((self.tile_m, self.group + 2)))
        if tidx < self.tile_m:
            i = m0 + tidx
            for f in cutlass.range_constexpr(self.group + 2):
                s_rows[tidx, f] = cutlass.Float32.inf if f <= self.group else 0.0
            if i < seqlen:
                for g in cutlass.range_constexpr(self.group):
                    s_rows[tidx, g] = lse[b, h0 + g, i] * LOG2E
                s_rows[tidx, self.group] = lse_proxy[b, p, i] * LOG2E
                s_rows[tidx, self.group + 1] = kl_grad[b, p, i]  # weights folded in below
        lse2 = RowView(s_rows, coord)
        a_sum = cute.make_rmem_tensor((rows,), cutlass.Float32)  # kl_value: the rows' A and T (this thread's keys)
        t_sum = cute.make_rmem_tensor((rows,), cutlass.Float32)
        for r in cutlass.range_constexpr(rows):
            a_sum[r] = 0.0
            t_sum[r] = 0.0

        for step in cutlass.range(n_steps, unroll=1):
            # K (loaded mid-step before) and K_p (a step ahead) of this tile have landed; every warp is past
            # the previous tile's reads of K_p stage (step + 1) % 2 and of s_ds.
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            if step + 1 < n_steps:
                load_rows(gcopy, self.dtype, k_proxy[b, None, pk, None], s_kp[None, None, (step + 1) % 2],
                          (step + 1) * self.tile_n, seqlen, tidx)
            cute.arch.cp_async_commit_group()
            t0 = step * self.tile_n
            s_kpt = s_kp[None, None, step % 2]

            self.issue(accs[0], s_q[None, None, 0], s_k, tidx)
            for n in cutlass.range_constexpr(self.group):
                if cutlass.const_expr(n + 1 < self.group):
                    self.issue(accs[(n + 1) % 2], s_q[None, None, n + 1], s_k, tidx)
                else:
                    self.issue(accs[(n + 1) % 2], s_q[None, None, self.group], s_kpt, tidx)
                warpgroup.wait_group(1)
                self.accumulate_tau(wg_acc_rows_cols(accs[n % 2]), tau_mn, lse2, n, scale_log2)
            warpgroup.wait_group(0)
            s_mn = wg_acc_rows_cols(accs[self.group % 2])
            if step >= first_masked:
                self.proxy_grad(s_mn, tau_mn, coord, s_rows, m0, t0, proxy_scale_log2, pi_weight, tau_weight, a_sum,
                                t_sum, True)
            else:
                self.proxy_grad(s_mn, tau_mn, coord, s_rows, m0, t0, proxy_scale_log2, pi_weight, tau_weight, a_sum,
                                t_sum, False)

            # dq_p += dS_p K_p from registers; dS_p to shared memory for dk_p.
            r_ds = cute.make_rmem_tensor_like(tau, self.dtype)
            r_ds.store(tau.load().to(self.dtype))
            self.issue_dq(acc_dq, r_ds, transposed(s_kpt), tidx)
            for e in cutlass.range_constexpr(cute.size(r_ds)):
                t_ds[e] = r_ds[e]
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()  # s_ds whole; every main product of this tile has read s_k
            warpgroup.wait_group(0)  # dq_p's registers (r_ds) free before dk_p's accumulator is live
            if step + 1 < n_steps:
                load_rows(gcopy, self.dtype, k[b, None, kv, None], s_k, (step + 1) * self.tile_n, seqlen, tidx)
            cute.arch.cp_async_commit_group()
            self.issue_dk(acc_dk, transposed(s_ds), transposed(s_q[None, None, self.group]), tidx)
            warpgroup.wait_group(0)
            dk_mn = wg_acc_rows_cols(acc_dk)
            for r in cutlass.range_constexpr(cute.size(dk_mn, mode=[0])):
                t = t0 + coord_dk[r, 0][0]
                if t < seqlen:
                    base = dkp_acc[b, t, pk, None].iterator.toint()
                    for c in cutlass.range_constexpr(0, cute.size(dk_mn, mode=[1]), 2):
                        red_add_v2(base + coord_dk[0, c][1] * 4, dk_mn[r, c] * proxy_scale,
                                   dk_mn[r, c + 1] * proxy_scale)

        dq_mn = wg_acc_rows_cols(acc_dq)
        coord_dq = wg_acc_rows_cols(thr_dq.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim))))
        for r in cutlass.range_constexpr(cute.size(dq_mn, mode=[0])):
            i = m0 + coord_dq[r, 0][0]
            if i < seqlen:
                # Each row belongs to this CTA alone; launches over a group's head chunks run one after another
                # on the stream, so a plain read-add-write accumulates them.
                for c in cutlass.range_constexpr(cute.size(dq_mn, mode=[1])):
                    d = coord_dq[0, c][1]
                    dqp_acc[b, i, p, d] = dqp_acc[b, i, p, d] + dq_mn[r, c] * proxy_scale
        if cutlass.const_expr(self.kl_value):
            self.write_kl(a_sum, t_sum, coord, lse_proxy, kl_rows, b, p, m0, seqlen, tidx)

    @cute.jit
    def write_kl(self, a_sum, t_sum, coord, lse_proxy, kl_rows, b, p, m0, seqlen, tidx):
        """Each row's A and T summed over its quad and its KL written once, as the KL pass's write_rows forms it
        (tau renormalised by T; lse_p is the forward's)."""
        for r in cutlass.range_constexpr(cute.size(a_sum)):
            a, t = a_sum[r], t_sum[r]
            for off in cutlass.range_constexpr(2):
                a += cute.arch.shuffle_sync_bfly(a, offset=2 >> off)
                t += cute.arch.shuffle_sync_bfly(t, offset=2 >> off)
            i = m0 + coord[r, 0][0]
            if i < seqlen and tidx % 4 == 0:
                kl = cutlass.Float32(0.0)
                if t != 0.0:  # unordered: a NaN tau (NaN in q or k) makes the KL NaN, not 0
                    kl = (a * cute.arch.rcp_approx(t) - cute.math.log2(t, fastmath=True)) * LN2 + lse_proxy[b, p, i]
                kl_rows[b, p, i] = kl

    @cute.jit
    def proxy_grad(self, s_mn, tau_mn, coord, s_rows, m0, t0, scale_log2, pi_weight, tau_weight, a_sum, t_sum,
                   masked: cutlass.Constexpr):
        """tau_mn <- dS_p = (pi_weight exp2(s_p scale log2e - lse_p log2e) - tau_weight tau_sum) * kl_grad, in
        place; keys t > i: 0. kl_value: first A += tau_sum (log2 tau_sum - s_p), T += tau_sum over the causal keys
        (kernels_src.kl_rows.kl_row_sums' terms)."""
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            key_limit = m0 + coord[r, 0][0] - t0
            lsep2 = s_rows[coord[r, 0][0], self.group]
            grad = s_rows[coord[r, 0][0], self.group + 1]
            pi_grad, tau_grad = pi_weight * grad, tau_weight * grad
            a = cutlass.Float32(0.0)
            t = cutlass.Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                ts = tau_mn[r, c]
                ds = (cute.math.exp2(s_mn[r, c] * scale_log2 - lsep2, fastmath=True) * pi_grad - ts * tau_grad)
                if cutlass.const_expr(masked):
                    if coord[0, c][1] > key_limit:
                        ds = cutlass.Float32(0.0)
                        ts = cutlass.Float32(0.0)
                if cutlass.const_expr(self.kl_value):
                    # ts = 0 (masked, or underflowed) adds 0, as in kl_row_sums
                    a += ts * (cute.math.log2(cute.arch.fmax(ts, FLT_MIN), fastmath=True) - s_mn[r, c] * scale_log2)
                    t += ts
                tau_mn[r, c] = ds
            if cutlass.const_expr(self.kl_value):
                a_sum[r] += a
                t_sum[r] += t

    @cute.jit
    def issue_dq(self, acc, r_a, s_b, tidx):
        """acc += A B^T with A in registers (the score accumulator's layout, bf16/f16), B by descriptor."""
        mma = self._dq_mma()
        thr = mma.get_slice(tidx)
        t_ra = cute.make_tensor(r_a.iterator, wg_acc_as_a(r_a.layout))
        t_rb = thr.make_fragment_B(thr.partition_B(s_b))
        wgmma.issue(mma, acc, t_ra, t_rb, accumulate=True)

    @cute.jit
    def issue_dk(self, acc, s_a, s_b, tidx):
        """acc = A B^T, both MN-major views by descriptor."""
        wgmma.issue_smem(self._dk_mma(), tidx, acc, s_a, s_b)
