"""Warmup KL pass, warp-specialised (sm90a): a producer warp streams the key tiles, and the two consumer warpgroups
take turns at the tensor cores (ping-pong).

The lockstep kernel (kernel.py) loads each key tile with all 256 threads and passes two CTA barriers per tile, so
both warpgroups run their MUFU / FP32-heavy proxy statistics at the same time, with no product in flight, and
then their first products at the same time (Nsight Compute: tensor pipe ~45 % busy, MUFU ~54 %, little overlap:
NOTES.md). Here:
  - warp 8 (threads 256..287) is the producer: it cp.asyncs K and K_p tile `step` into stage step % stages and
    arrives on full[stage] when its copies land (cp.async.mbarrier.arrive.noinc; 32 arrivals); before refilling a
    stage it waits on empty[stage], where each of the 8 consumer warps arrives once it has finished the products
    that read it. Rows past S are loaded as row S - 1 (a real, finite row): they lie in the causal mask's tiles,
    where keys t > i count for nothing.
  - the consumer warpgroups (threads 0..255) wait on full[stage] instead of a CTA barrier, and issue their first
    product of a step in turns (named barriers TURN + w, as kernels_src/sparse_fwd/pingpong.py).
Everything else (resident query tiles, the products, the statistics, the final write) is kernel.py's.
Measured: 2-3 % faster than kernel.py ((b) 64K 101.6 -> 99.5 ms; NOTES.md). The turns order the warpgroups' first
issues but do not hold one a phase behind the other, so their proxy statistics (MUFU work with no product in
flight) still coincide.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from kernels_src.barriers import WarmupKLPingPong as Bar
from kernels_src.constants import LOG2E, WARPGROUP_THREADS
from kernels_src.tiles import copy_row, cp_async_rows, load_rows, smem_tile, tile_storage, wg_acc_rows_cols
from kernels_src.warmup_kl.kernel import WarmupKL

CONSUMERS = 2 * WARPGROUP_THREADS  # the two warpgroups of the products


class WarmupKLPingPong(WarmupKL):
    # Threads per row of the row copies (tiles.cp_async_rows): 4 instead of 16, the producer warp's 8 rows per
    # instruction instead of 2: (a) / (b) S = 32K 1.05x.
    ROW_THREADS = 4

    def __init__(self, config):
        if config.threads != CONSUMERS + 32:
            raise ValueError(f"{type(self).__name__}: threads {config.threads}; {CONSUMERS} consumers + one producer "
                             f"warp only")
        super().__init__(dict_replace(config, threads=CONSUMERS))
        self.cfg = config
        self.block_threads = config.threads

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, q_proxy: cute.Tensor, k_proxy: cute.Tensor,
                 lse: cute.Tensor, lse_proxy: cute.Tensor, kl_rows: cute.Tensor, scale: cutlass.Float32,
                 proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32, stream):
        l_q = smem_tile(self.dtype, (self.tile_m, self.head_dim, self.group + 1))
        l_k = smem_tile(self.dtype, (self.tile_n, self.head_dim, self.stages))

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[cutlass.Int64, self.stages]
            empty: cute.struct.MemRange[cutlass.Int64, self.stages]
            s_lse: cute.struct.MemRange[cutlass.Float32, self.tile_m * self.group]
            s_q: tile_storage(self.dtype, l_q)
            s_k: tile_storage(self.dtype, l_k)
            s_kp: tile_storage(self.dtype, l_k)

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_ws(q, k, q_proxy, k_proxy, lse, lse_proxy, kl_rows, scale, proxy_scale, hp_per_hk, hp_per_hpk,
                       l_q, l_k,
                       cp_async_rows(self.dtype, self.head_dim, CONSUMERS, self.ROW_THREADS),
                       cp_async_rows(self.dtype, self.head_dim, 32, self.ROW_THREADS),
                       SharedStorage).launch(
            grid=(cute.ceil_div(q.shape[1], self.tile_m), q_proxy.shape[2], q.shape[0]),
            block=(self.block_threads, 1, 1), smem=self.traced["smem_bytes"], stream=stream)

    @cute.kernel
    def kernel_ws(self, q, k, q_proxy, k_proxy, lse, lse_proxy, kl_rows, scale: cutlass.Float32,
                  proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32,
                  l_q: cute.ComposedLayout,
                  l_k: cute.ComposedLayout, gcopy: cute.TiledCopy, gcopy_warp: cute.TiledCopy,
                  SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        b, p, m0, seqlen, n_steps, first_masked, kv, pk = self.query_tile(q, hp_per_hk, hp_per_hpk)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        s_q = storage.s_q.get_tensor(l_q.outer, swizzle=l_q.inner)
        s_k = storage.s_k.get_tensor(l_k.outer, swizzle=l_k.inner)
        s_kp = storage.s_kp.get_tensor(l_k.outer, swizzle=l_k.inner)
        s_lse = storage.s_lse.get_tensor(cute.make_layout((self.tile_m, self.group), stride=(self.group, 1)))
        self.init_ring(full, empty, tidx)

        if warp == CONSUMERS // 32:
            self.produce(gcopy_warp, ((k[b, None, kv, None], s_k), (k_proxy[b, None, pk, None], s_kp)), full, empty,
                         n_steps, seqlen, tidx - CONSUMERS)
        else:
            self.consume(q, q_proxy, lse, lse_proxy, kl_rows, scale, proxy_scale, s_q, s_k, s_kp, s_lse, full, empty,
                         gcopy, b, p, m0, seqlen, n_steps, first_masked, tidx)

    @cute.jit
    def init_ring(self, full, empty, tidx):
        """The key ring's mbarriers: full[stage] counts the producer's 32 lanes (each once its copies have landed),
        empty[stage] one lane per consumer warp."""
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(full + s, 32)
                cute.arch.mbarrier_init(empty + s, CONSUMERS // 32)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

    @cute.jit
    def produce(self, gcopy_warp, rings: cutlass.Constexpr, full, empty, n_steps, seqlen, lane):
        """The producer warp: key tile `step` of every (rows, shared ring) pair of rings into stage step % stages,
        after the consumers have released that stage, then full[stage]."""
        for step in cutlass.range(n_steps, unroll=1):
            stage = step % self.stages
            if step >= self.stages:
                cute.arch.mbarrier_wait(empty + stage, (step // self.stages + 1) % 2)
            t0 = step * self.tile_n
            for g_rows, s_ring in rings:
                self.load_clamped(gcopy_warp, g_rows, s_ring[None, None, stage], t0, seqlen, lane)
            cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)
        cute.arch.cp_async_commit_group()  # the warp leaves once its last copies have landed
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def load_clamped(self, gcopy_warp, g_rows, s_tile, r0, n_rows, lane):
        """cp.async rows [r0, r0 + tile_n) of g_rows into s_tile by one warp; rows past n_rows load row n_rows - 1."""
        thr = gcopy_warp.get_slice(lane)
        t_s = thr.partition_D(s_tile)
        t_c = thr.partition_S(cute.make_identity_tensor((cute.size(s_tile, mode=[0]), cute.size(s_tile, mode=[1]))))
        for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
            t = cutlass.min(r0 + t_c[0, m, 0][0], n_rows - 1)
            copy_row(gcopy_warp, self.dtype, g_rows[t, None], t_s, t_c, m)

    @cute.jit
    def consume(self, q, q_proxy, lse, lse_proxy, kl_rows, scale, proxy_scale, s_q, s_k, s_kp, s_lse, full, empty,
                gcopy, b, p, m0, seqlen, n_steps, first_masked, tidx):
        wg = tidx // 128
        for g in cutlass.range_constexpr(self.group):
            load_rows(gcopy, self.dtype, q[b, None, p * self.group + g, None], s_q[None, None, g], m0, seqlen, tidx)
        load_rows(gcopy, self.dtype, q_proxy[b, None, p, None], s_q[None, None, self.group], m0, seqlen, tidx)
        cute.arch.cp_async_commit_group()

        thr, accs, tau, tau_mn, coord = self.score_accumulators(tidx)
        rows = cute.size(tau_mn, mode=[0])
        scale_log2 = scale * LOG2E  # the main scores' (tau)
        proxy_scale_log2 = proxy_scale * LOG2E  # the proxy scores'

        row_max = cute.make_rmem_tensor((rows,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((rows,), cutlass.Float32)
        a_sum = cute.make_rmem_tensor((rows,), cutlass.Float32)
        t_sum = cute.make_rmem_tensor((rows,), cutlass.Float32)
        # lse_g * log2 e per row, in shared memory (+inf past S, so those rows' P is 0): a register per (row, head)
        # more and the consumers spill at the 224 registers 288 threads allow.
        for e in cutlass.range(tidx, self.tile_m * self.group, CONSUMERS, unroll=1):
            row = e // self.group
            g = e - row * self.group
            s_lse[row, g] = cutlass.Float32.inf
            if m0 + row < seqlen:
                s_lse[row, g] = lse[b, p * self.group + g, m0 + row] * LOG2E
        for r in cutlass.range_constexpr(rows):
            row_max[r] = -cutlass.Float32.inf
            row_sum[r] = 0.0
            a_sum[r] = 0.0
            t_sum[r] = 0.0

        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=Bar.QUERIES, number_of_threads=CONSUMERS)  # query tiles from every consumer
        if wg == 1:
            cute.arch.barrier_arrive(barrier_id=Bar.TURN, number_of_threads=CONSUMERS)

        for step in cutlass.range(n_steps, unroll=1):
            stage = step % self.stages
            t0 = step * self.tile_n
            cute.arch.mbarrier_wait(full + stage, (step // self.stages) % 2)
            cute.arch.fence_view_async_shared()  # the producer's cp.async writes -> this warpgroup's wgmma reads

            cute.arch.barrier(barrier_id=Bar.TURN + wg, number_of_threads=CONSUMERS)
            self.issue(accs[0], s_q[None, None, 0], s_k[None, None, stage], tidx)
            cute.arch.barrier_arrive(barrier_id=Bar.TURN + 1 - wg, number_of_threads=CONSUMERS)
            for n in cutlass.range_constexpr(self.group + 1):
                if cutlass.const_expr(n + 1 < self.group):
                    self.issue(accs[(n + 1) % 2], s_q[None, None, n + 1], s_k[None, None, stage], tidx)
                elif cutlass.const_expr(n + 1 == self.group):
                    self.issue(accs[(n + 1) % 2], s_q[None, None, self.group], s_kp[None, None, stage], tidx)
                warpgroup.wait_group(1 if n < self.group else 0)
                if cutlass.const_expr(n == self.group):
                    # Every product reading this stage is done (this warp's share): the producer may refill it.
                    if tidx % 32 == 0:
                        cute.arch.mbarrier_arrive(empty + stage)
                s_mn = wg_acc_rows_cols(accs[n % 2])
                if cutlass.const_expr(n < self.group):
                    self.accumulate_tau_smem(s_mn, tau_mn, s_lse, coord, n, scale_log2)
                else:
                    if step >= first_masked:
                        self.proxy_row_stats(s_mn, tau_mn, coord, row_max, row_sum, a_sum, t_sum, m0, t0,
                                             proxy_scale_log2,
                                             True)
                    else:
                        self.proxy_row_stats(s_mn, tau_mn, coord, row_max, row_sum, a_sum, t_sum, m0, t0,
                                             proxy_scale_log2,
                                             False)
        if wg == 0:  # warpgroup 1's last arrival on TURN + 0 (pingpong accounting)
            cute.arch.barrier(barrier_id=Bar.TURN, number_of_threads=CONSUMERS)
        self.write_rows(row_max, row_sum, a_sum, t_sum, coord, lse_proxy, kl_rows, b, p, m0, seqlen, tidx)


    @cute.jit
    def accumulate_tau_smem(self, s_mn, tau_mn, s_lse, coord, g: cutlass.Constexpr, scale_log2):
        """accumulate_tau with lse_g read from the shared table (one load per row and head)."""
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            lse2 = s_lse[coord[r, 0][0], g]
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                e = cute.math.exp2(s_mn[r, c] * scale_log2 - lse2, fastmath=True)
                if cutlass.const_expr(g == 0):
                    tau_mn[r, c] = e
                else:
                    tau_mn[r, c] += e


def dict_replace(config, **fields):
    """A copy of the frozen config dataclass with fields replaced."""
    import dataclasses

    return dataclasses.replace(config, **fields)
