"""MSA sparse forward (CuTeDSL): KV-outer, gathered query rows, warp-level mma.sync.

One CTA per work item (flash_msa_rt.ops.sparse_plan): key block j of (b, p) and up to a few tiles of the queries
that selected it. Per item:
  1. cp.async loads the block's K and V (kv head p // (Hp/Hk)) once;
  2. per tile of 128 rows, row r = (query r // G, head p*G + r % G), cp.async gathers the rows of q (double
     buffered: the next tile's gather overlaps this tile's math);
  3. 8 warps x 16 rows, ldmatrix + mma.sync 16x8x16: S = Q K^T over the block's 128 keys, causal mask t > i;
  4. the block's own softmax (one block, so no online rescaling), O_slot = P V / l and lse_slot, written at the
     entry's destination row for the combine kernel's logsumexp merge.
No proxy work here: the KL pass (kernels_src.sparse_kl) also produces the proxy lse, through
KL = sum_t tau (log tau - s_p) + lse_p * sum_t tau, which needs no lse_p while it runs.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from kernels_src.constants import DTYPES, LN2, LOG2E
from kernels_src.tiles import acc_as_frg_a, acc_rows_cols, copy_row, cp_async_rows, smem_tile, tile_storage, warp_mma
from kernels_src.work_items import item_block, keys_in_query_rows


class SparseAttention:
    def __init__(self, config):
        self.cfg = config
        self.dtype = DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.block_size = config.block_size
        self.group = config.group
        self.tile_m = config.tile_m
        self.tile_queries = config.tile_m // config.group
        self.threads = config.threads
        self.stages = config.stages
        self.traced: dict = {}

    # ------------------------------------------------------------------ host side

    def _tiled_mma(self):
        # Warps tile M only: each warp owns 16 rows against all 128 keys (QK) or all D columns (PV), so row
        # statistics need just a quad shuffle.
        return warp_mma(self.dtype, self.threads // 32, 1)

    def _tiled_mma_pv(self):
        """The PV product's MMA: the same warp MMA here (P is reused from the QK accumulator's registers)."""
        return self._tiled_mma()

    def rows_cols(self, t: cute.Tensor) -> cute.Tensor:
        """The rows x columns one thread holds of an accumulator (or of its coordinates)."""
        return acc_rows_cols(t)

    @cute.jit
    def forward(
        self,
        q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
        entry_query: cute.Tensor, entry_dest: cute.Tensor, items: cute.Tensor,
        o_part: cute.Tensor, lse_part: cute.Tensor,
        scale: cutlass.Float32, hp: cutlass.Int32, hp_per_hk: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        # Not named like the struct's fields: a class body looks its field names up in its own scope.
        l_q = smem_tile(self.dtype, (self.tile_m, self.head_dim, self.stages))
        l_k = smem_tile(self.dtype, (self.block_size, self.head_dim))

        @cute.struct
        class SharedStorage:
            s_q: tile_storage(self.dtype, l_q)
            s_k: tile_storage(self.dtype, l_k)
            s_v: tile_storage(self.dtype, l_k)

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel_forward(
            q, k, v, entry_query, entry_dest, items, o_part, lse_part, scale, hp, hp_per_hk, l_q, l_k,
            cp_async_rows(self.dtype, self.head_dim, self.threads), SharedStorage,
        ).launch(grid=(items.shape[0], 1, 1), block=(self.threads, 1, 1), smem=self.traced["smem_bytes"],
                 stream=stream, **self.occupancy())

    def o_pieces(self) -> int:
        """Column pieces of O = P V, formed and stored one after another: at D 256 two, so that the mma.sync kernel
        holds 64 rather than 128 registers of O (at 128 it spilled at G = 16, ptxas)."""
        return 2 if self.head_dim > 128 else 1

    def occupancy(self) -> dict:
        """Launch bounds: none here (one CTA per SM, shared memory bound)."""
        return {}

    # ------------------------------------------------------------------ device side: the kernel

    @cute.kernel
    def kernel_forward(
        self, q, k, v, entry_query, entry_dest, items, o_part, lse_part,
        scale: cutlass.Float32, hp: cutlass.Int32, hp_per_hk: cutlass.Int32,
        s_q_layout: cute.ComposedLayout, s_k_layout: cute.ComposedLayout,
        gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        w, _, _ = cute.arch.block_idx()
        n_entries = items[w, 3]
        if n_entries > 0:
            b, p, start, t0 = self.item_block(items, w, hp)
            seqlen, q_t0 = keys_in_query_rows(t0, q, k)  # the causal mask compares rows with q_t0
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_q_all, s_k, s_v, s_vt = self.smem_views(storage, s_q_layout, s_k_layout)
            self.load_block(gcopy, k[b, None, p // hp_per_hk, None], s_k, t0, seqlen, tidx, zero_tail=False)
            self.load_block(gcopy, v[b, None, p // hp_per_hk, None], s_v, t0, seqlen, tidx, zero_tail=True)
            tiled_mma, tiled_mma_pv, thr_mma, thr_pv, acc, acc_mn, coord_mn, acc_o, acc_o_mn, coord_o = \
                self.accumulators(tidx)
            quad_lane = tidx % 4
            scale_log2 = scale * LOG2E

            n_tiles = cute.ceil_div(n_entries, self.tile_queries)
            self.gather_tile(gcopy, q, s_q_all, b, p, entry_query, start, n_entries, 0, tidx)
            for tile in cutlass.range(n_tiles, unroll=1):
                e0 = start + tile * self.tile_queries
                n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
                s_q = s_q_all[None, None, tile % self.stages]
                # Prefetch tile + 1 into the other buffer (an empty group past the last tile keeps the count).
                if tile + 1 < n_tiles:
                    self.gather_tile(gcopy, q, s_q_all, b, p, entry_query, start, n_entries, tile + 1, tidx)
                else:
                    cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)
                self.publish_async_copies()
                cute.arch.sync_threads()

                # The block's softmax, then O_slot = P V / l.
                self.qk(tiled_mma, thr_mma, acc, s_q, s_k, tidx)
                lse_rows = cute.make_rmem_tensor((2,), cutlass.Float32)
                inv_l = cute.make_rmem_tensor((2,), cutlass.Float32)
                self.tile_softmax(acc_mn, coord_mn, entry_query, e0, n_q, q_t0, scale_log2, lse_rows, inv_l)
                if cutlass.const_expr(self.o_pieces() == 1):
                    self.pv(tiled_mma_pv, thr_pv, acc, acc_o, s_vt, tidx)
                    self.store_tile(acc_o_mn, coord_mn, coord_o, lse_rows, inv_l, entry_dest, o_part, lse_part, e0,
                                    n_q, quad_lane)
                else:
                    cols = self.head_dim // self.o_pieces()
                    for h in cutlass.range_constexpr(self.o_pieces()):
                        self.pv(tiled_mma_pv, thr_pv, acc, acc_o, cute.local_tile(s_vt, (cols, self.block_size), (h, 0)),
                                tidx)
                        coord_h = self.rows_cols(thr_pv.partition_C(cute.local_tile(
                            cute.make_identity_tensor((self.tile_m, self.head_dim)), (self.tile_m, cols), (0, h))))
                        self.store_tile(acc_o_mn, coord_mn, coord_h, lse_rows, inv_l, entry_dest, o_part, lse_part,
                                        e0, n_q, quad_lane)
                # Every warp is past its reads of this buffer before the gather of tile + 2 overwrites it.
                cute.arch.sync_threads()

    # ------------------------------------------------------------------ device side: shared pieces

    @cute.jit
    def publish_async_copies(self):
        """Between a thread's completed cp.async writes and the barrier before the MMAs read them: nothing for
        ldmatrix (generic proxy); the wgmma subclass fences them into the async proxy."""
        pass

    @cute.jit
    def load_block(self, gcopy, g_rows: cute.Tensor, s_tile: cute.Tensor, t0, seqlen, tidx, zero_tail):
        """cp.async the key block's rows [t0, t0 + Bs) of one head (g_rows: (Sk, D)). Rows past the keys
        are not loaded; zero_tail fills them with zeros (V: their P is 0, and 0 * garbage could be NaN)."""
        thr = gcopy.get_slice(tidx)
        cols = cute.size(s_tile, mode=[1])
        t_s = thr.partition_D(s_tile)
        t_c = thr.partition_S(cute.make_identity_tensor((self.block_size, cols)))
        for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
            t = t0 + t_c[0, m, 0][0]
            if t < seqlen:
                copy_row(gcopy, self.dtype, g_rows[t, None], t_s, t_c, m)
            elif cutlass.const_expr(zero_tail):
                t_s[None, m, None].fill(0)

    @cute.jit
    def gather_tile(self, gcopy, q, s_q_all, b, p, entry_query, start, n_entries, tile, tidx):
        """cp.async, as one group, tile row r <- q[b, i, p*G + r % G] with i = entry_query[e0 + r // G] into buffer
        tile % stages. Rows of queries past the tile's count are left as they are (never stored)."""
        e0 = start + tile * self.tile_queries
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        s_tile = s_q_all[None, None, tile % self.stages]
        head_base = p * self.group
        thr = gcopy.get_slice(tidx)
        cols = cute.size(s_tile, mode=[1])
        t_s = thr.partition_D(s_tile)
        t_c = thr.partition_S(cute.make_identity_tensor((self.tile_m, cols)))
        for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
            row = t_c[0, m, 0][0]
            qi = row // self.group
            if qi < n_q:
                i = entry_query[e0 + qi]
                copy_row(gcopy, self.dtype, q[b, i, head_base + row % self.group, None], t_s, t_c, m)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def qk(self, tiled_mma, thr_mma, acc, s_a, s_b, tidx, prefetch: cutlass.Constexpr = True):
        """acc = A B^T over the tile (fp32, unscaled), operands read from swizzled smem by ldmatrix; prefetch
        loads step k + 1's fragments before step k's MMAs (32 more registers live)."""
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        copy_a = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        copy_b = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        t_ra = thr_mma.make_fragment_A(thr_mma.partition_A(s_a))
        t_rb = thr_mma.make_fragment_B(thr_mma.partition_B(s_b))
        t_sa, t_sb = copy_a.partition_S(s_a), copy_b.partition_S(s_b)
        t_ra_v, t_rb_v = copy_a.retile(t_ra), copy_b.retile(t_rb)
        acc.fill(0.0)
        steps = cute.size(t_ra, mode=[2])
        if cutlass.const_expr(prefetch):
            cute.copy(copy_a, t_sa[None, None, 0], t_ra_v[None, None, 0])
            cute.copy(copy_b, t_sb[None, None, 0], t_rb_v[None, None, 0])
        for kk in cutlass.range_constexpr(steps):
            if cutlass.const_expr(not prefetch):
                cute.copy(copy_a, t_sa[None, None, kk], t_ra_v[None, None, kk])
                cute.copy(copy_b, t_sb[None, None, kk], t_rb_v[None, None, kk])
            elif cutlass.const_expr(kk + 1 < steps):
                cute.copy(copy_a, t_sa[None, None, kk + 1], t_ra_v[None, None, kk + 1])
                cute.copy(copy_b, t_sb[None, None, kk + 1], t_rb_v[None, None, kk + 1])
            cute.gemm(tiled_mma, acc, t_ra[None, None, kk], t_rb[None, None, kk], acc)

    @cute.jit
    def pv(self, tiled_mma, thr_mma, acc_p, acc_o, s_vt, tidx):
        """acc_o = P V with P taken from the score accumulator as bf16/f16 A fragments (register reuse: two
        adjacent n8 accumulator tiles are one k16 A fragment) and V^T read by ldmatrix.trans."""
        r_p = cute.make_rmem_tensor_like(acc_p, self.dtype)
        r_p.store(acc_p.load().to(self.dtype))
        t_rp = cute.make_tensor(r_p.iterator, acc_as_frg_a(r_p.layout))
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        copy_v = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        t_rv = thr_mma.make_fragment_B(thr_mma.partition_B(s_vt))
        t_sv, t_rv_v = copy_v.partition_S(s_vt), copy_v.retile(t_rv)
        acc_o.fill(0.0)
        steps = cute.size(t_rv, mode=[2])
        cute.copy(copy_v, t_sv[None, None, 0], t_rv_v[None, None, 0])
        for kk in cutlass.range_constexpr(steps):
            if cutlass.const_expr(kk + 1 < steps):
                cute.copy(copy_v, t_sv[None, None, kk + 1], t_rv_v[None, None, kk + 1])
            cute.gemm(tiled_mma, acc_o, t_rp[None, None, kk], t_rv[None, None, kk], acc_o)

    def item_block(self, items, w, hp):
        """Trace time: work item w's batch b, proxy head p (bp = b * Hp + p), first entry and key block start."""
        return item_block(items, w, hp, self.block_size)

    def smem_views(self, storage, s_q_layout, s_k_layout):
        """Trace time: the q tile buffers, K, V and V^T (D, keys) for the PV product's B operand (the same bytes,
        modes swapped, read by ldmatrix.trans or wgmma's MN-major descriptor)."""
        s_q_all = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)
        s_k = storage.s_k.get_tensor(s_k_layout.outer, swizzle=s_k_layout.inner)
        s_v = storage.s_v.get_tensor(s_k_layout.outer, swizzle=s_k_layout.inner)
        s_vt = storage.s_v.get_tensor(cute.select(s_k_layout.outer, mode=[1, 0]), swizzle=s_k_layout.inner)
        return s_q_all, s_k, s_v, s_vt

    def accumulators(self, tidx):
        """Trace time: the QK and PV MMAs, this thread's slices, the score and output accumulators with their
        rows x columns views and coordinates. Made in the kernel, not passed in: wgmma's tiled MMA carries runtime
        state (its accumulate flag), which would become kernel parameters."""
        tiled_mma, tiled_mma_pv = self._tiled_mma(), self._tiled_mma_pv()
        thr_mma = tiled_mma.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.block_size)), cutlass.Float32)
        acc_mn = self.rows_cols(acc)
        coord_mn = self.rows_cols(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.block_size))))
        cols = self.head_dim // self.o_pieces()
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, cols)), cutlass.Float32)
        acc_o_mn = self.rows_cols(acc_o)
        coord_o = self.rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, cols))))
        return tiled_mma, tiled_mma_pv, thr_mma, thr_pv, acc, acc_mn, coord_mn, acc_o, acc_o_mn, coord_o

    @cute.jit
    def tile_softmax(self, acc_mn, coord_mn, entry_query, e0, n_q, t0, scale_log2, lse_rows, inv_l):
        """The block's own softmax of this thread's two rows, in place: the causal mask, P = exp2 of the scaled
        scores less their max; lse_rows (natural log) and inv_l = 1 / row sum for the epilogue."""
        for r in cutlass.range_constexpr(2):
            qi = coord_mn[r, 0][0] // self.group
            i = self.row_query(entry_query, e0, qi, n_q, t0)
            self.softmax_row(acc_mn, coord_mn, r, i - t0, scale_log2, lse_rows, inv_l)

    @cute.jit
    def softmax_row(self, acc_mn, coord_mn, r, key_limit, scale_log2, lse_rows, inv_l):
        """Row r of tile_softmax, its query given as key_limit = i - t0 (t0 in query rows: q_t0)."""
        self.mask_row(acc_mn, coord_mn, r, key_limit)
        row_max, row_sum = self.row_exp(acc_mn, r, scale_log2)
        lse_rows[r] = (row_max * scale_log2 + cute.math.log2(row_sum, fastmath=True)) * LN2
        inv_l[r] = cute.arch.rcp_approx(row_sum)

    @cute.jit
    def store_tile(self, acc_o_mn, coord_mn, coord_o, lse_rows, inv_l, entry_dest, o_part, lse_part, e0, n_q,
                   quad_lane):
        """O_slot = (P V) / l and lse_slot of this thread's rows of the tile's queries, at their entries' rows."""
        for r in cutlass.range_constexpr(2):
            row = coord_mn[r, 0][0]
            qi = row // self.group
            if qi < n_q:
                # 64-bit: the (E, G, D) partial buffer passes 2**31 elements at benchmark sizes.
                self.store_row(acc_o_mn, coord_o, r, row, cutlass.Int64(entry_dest[e0 + qi]), lse_rows, inv_l,
                               o_part, lse_part, quad_lane)

    @cute.jit
    def store_row(self, acc_o_mn, coord_o, r, row, dest, lse_rows, inv_l, o_part, lse_part, quad_lane):
        """Row r of store_tile (tile row `row`), at partial row `dest` (Int64)."""
        g = row % self.group
        if quad_lane == 0:
            lse_part[dest, g] = lse_rows[r]
        for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
            o_part[dest, g, coord_o[0, c][1]] = (acc_o_mn[r, c] * inv_l[r]).to(self.dtype)

    @cute.jit
    def row_query(self, entry_query, e0, qi, n_q, t0):
        """The query of tile query qi; past n_q, a position that masks nothing (the row is never stored)."""
        i = t0 + self.block_size
        if qi < n_q:
            i = entry_query[e0 + qi]
        return i

    @cute.jit
    def mask_row(self, acc_mn, coord_mn, r, key_limit):
        """Keys t > i: -inf (key_limit = i - t0). Covers keys past the sequence of a partial last block too."""
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            if coord_mn[0, c][1] > key_limit:
                acc_mn[r, c] = -cutlass.Float32.inf

    @cute.jit
    def row_exp(self, acc_mn, r, scale_log2):
        """In place P = exp2((s - max) * scale * log2 e); returns (max, sum) of the row over its quad."""
        row_max = acc_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
        row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
        row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=1))
        shift = row_max * scale_log2
        row_sum = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            e = cute.math.exp2(acc_mn[r, c] * scale_log2 - shift, fastmath=True)
            acc_mn[r, c] = e
            row_sum += e
        row_sum += cute.arch.shuffle_sync_bfly(row_sum, offset=2)
        row_sum += cute.arch.shuffle_sync_bfly(row_sum, offset=1)
        return row_max, row_sum
