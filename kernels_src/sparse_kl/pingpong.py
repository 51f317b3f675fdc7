"""MSA KL pass on wgmma with the two warpgroups on their own tiles (sm90a only, resident heads: G <= 4).

The lockstep kernel (wgmma.py) splits every tile's 128 keys between the warpgroups (m64n64 each), so both run
each phase together: a CTA barrier, G + 1 products interleaved with their exponentials, the (A, T, L) epilogue,
a CTA barrier. At (b) S = 64K that is ~6.6 us per tile against ~1.6 us of MUFU work (the pass's floor) and
~1.3 us of tensor work: the phases, not a pipe, set the pace.

Here warpgroup w takes tiles w, w + 2, ... of the item, all 128 keys of each (m64n128), gathers their G + 1 rows
into its own buffers with a 128-thread cp.async copy and waits on its own named barrier; the two meet once per
item, after the key block's load. Nothing else couples them, so one warpgroup's exponentials and epilogue run
under the other's products (the forward's ping-pong gained 1.10-1.25x that way: kernels_src/sparse_fwd/NOTES.md).
Per warpgroup and tile: for each head n, S_n = Q_n K^T then tau += exp2(S_n - lse_n); the next tile's main-head
rows are gathered as soon as the last main product is done (their buffers are free), its proxy rows after the
proxy product, both before the epilogue, so the gathers fly under the epilogue and the other warpgroup's work.
Single-buffered: 2 x (G + 1) tiles of 16 KB beside the 64 KB key block is 224 KB at G = 4. A tile's plan entries
(its queries) are staged into a two-slot ring per warpgroup two tiles ahead, with the gathers of the tile before
(one 4-byte cp.async per query), so a gather starts from shared memory instead of a dependent global load.
A warpgroup holds all of its rows' keys, so it writes one (A, T, L) triple per entry (kl_part: 3 columns).
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from kernels_src import wgmma
from kernels_src.barriers import SparseKLPingPong as Bar
from kernels_src.constants import LOG2E, WARPGROUP_THREADS
from kernels_src.sparse_kl.wgmma import SparseKLWG
from kernels_src.tiles import WARPGROUP_ROWS, cp_async_rows, cp_async_word, tile_storage, warpgroup_of
from kernels_src.work_items import keys_in_query_rows

ENTRY_RING = 2  # entry slots per warpgroup: its next tile's and the one after
_K = cute.nvgpu.OperandMajorMode.K


class SparseKLPingPong(SparseKLWG):
    # Gather rows: 8 threads each (16 -> 8: (b) 64K chunk 1.84 -> 1.67 ms; 4 spills at G = 4).
    ROW_THREADS = 8

    def __init__(self, config):
        super().__init__(config)
        self._check_schedule()

    def _check_schedule(self):
        if not self.resident or self.tile_n != self.block_size or self.stages != 1:
            raise ValueError(f"sparse_kl ping-pong: resident heads on the whole block, single-buffered only; got "
                             f"G {self.group}, tile_n {self.tile_n}, stages {self.stages}")

    def _wg_score_mma(self):
        """One warpgroup's m64n(block) product: warpgroup w issues it on its own rows (thread index tidx % 128)."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, _K, _K, cutlass.Float32, (1, 1, 1),
                                                 (WARPGROUP_ROWS, self.tile_n))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, q_proxy: cute.Tensor, k_proxy: cute.Tensor,
                 entry_query: cute.Tensor, entry_dest: cute.Tensor, items: cute.Tensor, lse: cute.Tensor,
                 kl_part: cute.Tensor, scale: cutlass.Float32, proxy_scale: cutlass.Float32,
                 hp_per_hk: cutlass.Int32, hp_per_hpk: cutlass.Int32, stream: cuda.CUstream):
        l_kv = self._smem_layout((self.tile_n, self.head_dim))
        # buffer w * (G + 1) + n: warpgroup w's rows of head n (n = G the proxy)
        l_rows = self._smem_layout((self.tile_m, self.head_dim, 2 * (self.group + 1)))

        @cute.struct
        class SharedStorage:
            s_k: tile_storage(self.dtype, l_kv)
            s_kp: tile_storage(self.dtype, l_kv)
            s_q: tile_storage(self.dtype, l_rows)
            s_ent: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, ENTRY_RING * self.tile_m * 2], 1024]

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_pingpong(q, k, q_proxy, k_proxy, entry_query, entry_dest, items, lse, kl_part, scale,
                             proxy_scale, hp_per_hk, hp_per_hpk, l_kv, l_rows, self._gmem_copy(), SharedStorage).launch(
            grid=(items.shape[0], 1, 1), block=(self.threads, 1, 1), smem=self.traced["smem_bytes"], stream=stream)

    @cute.kernel
    def kernel_pingpong(self, q, k, q_proxy, k_proxy, entry_query, entry_dest, items, lse, kl_part,
                        scale: cutlass.Float32, proxy_scale: cutlass.Float32, hp_per_hk: cutlass.Int32,
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
            seqlen, q_t0 = keys_in_query_rows(t0, q, k)
            wg, wg_tidx = warpgroup_of(tidx)
            heads = self.group + 1
            base = wg * heads  # this warpgroup's buffers
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_k, s_kp = self.key_tiles(storage, l_kv, gcopy, k, k_proxy, b, p // hp_per_hk, p // hp_per_hpk, t0,
                                       seqlen, tidx)
            s_q = storage.s_q.get_tensor(l_rows.outer, swizzle=l_rows.inner)

            acc, s_mn, tau, tau_mn, coord = self.wg_accumulators(wg_tidx)
            rows = cute.size(tau_mn, mode=[0])
            scale_log2 = scale * LOG2E  # the main scores' (tau)
            proxy_scale_log2 = proxy_scale * LOG2E  # the proxy scores' (pi, lse_p, the KL's A)
            quad_lane = tidx % 4

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            my_tiles = (n_tiles - wg + 1) // 2  # tiles wg, wg + 2, ...
            row_i = cute.make_rmem_tensor((rows,), cutlass.Int32)
            lse2 = cute.make_rmem_tensor((rows, self.group), cutlass.Float32)
            next_i = cute.make_rmem_tensor((rows,), cutlass.Int32)
            next_lse2 = cute.make_rmem_tensor((rows, self.group), cutlass.Float32)
            # ring[w, it % 2]: the entries of warpgroup w's it-th tile (wg + 2 it)
            ring = storage.s_ent.get_tensor(cute.make_layout((self.tile_m, ENTRY_RING, 2)))
            if my_tiles > 0:
                self.stage_entries(entry_query, ring[None, 0, wg], start, n_entries, wg, wg_tidx)
                self.stage_entries(entry_query, ring[None, 1, wg], start, n_entries, wg + 2, wg_tidx)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)  # the ring's group, which also holds the key block's copies
                cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)
                self.load_row_data(entry_query, lse, b, p, start, n_entries, wg, coord, row_i, lse2,
                                   s_ent=ring[None, 0, wg])
                self.gather_heads(gcopy_wg, q, q_proxy, s_q, b, p, entry_query, start, n_entries, wg, wg_tidx,
                                  base=base, s_ent=ring[None, 0, wg])
            cute.arch.cp_async_wait_group(0)
            self.publish_async_copies()
            cute.arch.sync_threads()  # the key block came from both warpgroups' threads

            for it in cutlass.range(my_tiles, unroll=1):
                tile = wg + 2 * it
                e0 = start + tile * self.tile_queries
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                self.await_rows(it, wg)
                # Read before this tile's slot takes tile + 4's entries below. Entries are sorted by query: only a
                # tile whose first query lies inside the block sees t > i.
                masked = ring[0, it % ENTRY_RING, wg] < q_t0 + self.block_size - 1
                s_next = ring[None, (it + 1) % ENTRY_RING, wg]  # tile + 2's entries
                for n in cutlass.range_constexpr(self.group):
                    self.wg_product(acc, s_q[None, None, base + n], s_k, wg_tidx)
                    if cutlass.const_expr(n + 1 == self.group):
                        # Once every warp of the warpgroup is past its wait, every main product is complete and
                        # their buffers take the next tile's rows while this one finishes.
                        if tile + 2 < n_tiles:
                            cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)
                            self.gather_heads(gcopy_wg, q, q_proxy, s_q, b, p, entry_query, start, n_entries,
                                              tile + 2, wg_tidx, base=base, first=0, count=self.group,
                                              s_ent=s_next)
                    for r in cutlass.range_constexpr(rows):
                        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                            e = cute.math.exp2(s_mn[r, c] * scale_log2 - lse2[r, n], fastmath=True)
                            if cutlass.const_expr(n == 0):
                                tau_mn[r, c] = e
                            else:
                                tau_mn[r, c] += e
                self.wg_product(acc, s_q[None, None, base + self.group], s_kp, wg_tidx)
                if tile + 2 < n_tiles:
                    cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)
                    # This tile's slot is read by nobody past the barrier at its top: it takes tile + 4's
                    # entries, in the group of tile + 2's proxy rows.
                    self.stage_entries(entry_query, ring[None, it % ENTRY_RING, wg], start, n_entries, tile + 4,
                                       wg_tidx)
                    self.gather_heads(gcopy_wg, q, q_proxy, s_q, b, p, entry_query, start, n_entries, tile + 2,
                                      wg_tidx, base=base, first=self.group, count=1, s_ent=s_next)
                    # lse_g unscaled: scaled at the tile's end, so its loads fly under write_shares.
                    self.load_row_data(entry_query, lse, b, p, start, n_entries, tile + 2, coord, next_i,
                                       next_lse2, s_ent=s_next, log2e=False)
                if masked:
                    self.write_shares(s_mn, tau_mn, coord, row_i, entry_dest, kl_part, e0, n_q, q_t0, 0, quad_lane,
                                      proxy_scale_log2, True)
                else:
                    self.write_shares(s_mn, tau_mn, coord, row_i, entry_dest, kl_part, e0, n_q, q_t0, 0, quad_lane,
                                      proxy_scale_log2, False)
                for r in cutlass.range_constexpr(rows):
                    row_i[r] = next_i[r]
                    for g in cutlass.range_constexpr(self.group):
                        lse2[r, g] = next_lse2[r, g] * LOG2E

    @cute.jit
    def await_rows(self, it, wg):
        """Warpgroup wg's it-th tile's gathered rows are in shared memory, visible to wgmma (the first tile's are
        awaited before the loop, with the key block)."""
        if it > 0:
            cute.arch.cp_async_wait_group(0)
            self.publish_async_copies()
            cute.arch.barrier(barrier_id=Bar.ROWS + wg, number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def stage_entries(self, entry_query, s_slot, start, n_entries, tile, wg_tidx):
        """cp.async `tile`'s entries (queries) into a ring slot, one 4-byte copy per query (threads 0 .. 63 of the
        warpgroup); nothing past the item's tiles. The caller commits."""
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        if wg_tidx < n_q:
            cute.copy(cp_async_word(cutlass.Int32),
                      cute.make_tensor(entry_query.iterator + start + tile * self.tile_queries + wg_tidx,
                                       cute.make_layout(1)),
                      cute.make_tensor(s_slot.iterator + wg_tidx, cute.make_layout(1)))

    def wg_accumulators(self, wg_tidx):
        """Trace time: this warpgroup's score accumulator and tau_sum (64 rows x the block's keys) with their rows x
        columns views, and the (row, key) coordinates of a thread's values."""
        thr_s = self._wg_score_mma().get_slice(wg_tidx)
        acc_shape = thr_s.partition_shape_C((self.tile_m, self.tile_n))
        acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        tau = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        coord = self.rows_cols(thr_s.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        return acc, self.rows_cols(acc), tau, self.rows_cols(tau), coord

    @cute.jit
    def wg_product(self, acc, s_a, s_b, wg_tidx):
        """acc = A B^T on this warpgroup's 64 rows and all the block's keys, waited for. The MMA is remade here: its
        accumulate flag is state set per step."""
        wgmma.issue_smem(self._wg_score_mma(), wg_tidx, acc, s_a, s_b)
        warpgroup.wait_group(0)
