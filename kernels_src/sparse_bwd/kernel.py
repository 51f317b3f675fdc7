"""MSA main sparse backward (CuTeDSL): KV-outer, gathered 64-row tiles, warp-level mma.sync, fp32 atomics.

Two CTAs per work item (key block j of (b, p) and the queries that chose it), each owning 64 of the block's keys
(with all 128 keys one CTA's dK and dV took 128 registers per thread and the kernel spilled), 8 warps:
  - S = Q K^T and dP = dO V^T with warps 4 (rows) x 2 (keys): 32 fp32 registers each per thread;
  - P = exp(S - lse) on the causal keys, dS = P (dP - delta), both stored to shared memory (rows x keys);
  - dV += P^T dO and dK += dS^T Q with warps 4 (keys) x 2: 32 registers each, kept across the item's tiles;
  - dQ = dS K with warps 4 x 2, times scale, staged in shared memory (fp32, a query's G head rows contiguous,
    padded per query against bank conflicts) and added to the fp32 dq accumulator with one bulk reduction per
    query (cp.reduce.async.bulk), which runs while the next tile computes;
  - at the item's end dV and scale * dK go to the fp32 dk / dv accumulators with vector atomics.
The deterministic variants (wgmma, tau_out = 1) make the order of every fp32 sum fixed: a query's staged dq rows
are stored to its slot's row of dq_part (entry_dest), which the runtime sums over the query's slots in slot order
(flash_msa_rt.ops.sparse_bwd_sums); the items of one key block take turns at their dk / dv atomics in item order
(item_prev[w]: the item before w on the same rows, whose item_done flag w waits for before its own atomics).
Tile rows are head-major (row_query, row_head). The item's entries are staged in shared memory once, and each
tile's lse and delta with its gather, so no phase starts with a dependent global load (NOTES.md).
Transposed operands are transposed views of the same swizzled tiles, read with ldmatrix.trans.
Rows of queries past the tile's count are zero-filled so that they add exactly nothing.
The wgmma subclass (wgmma.py) takes the whole 128-key block per CTA with the same loop.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from kernels_src.atomics import bulk_reduce_add_f32, bulk_store_f32, raise_flag, red_add_v2, wait_flag
from kernels_src.barriers import SparseBackward as Bar
from kernels_src.constants import DTYPES, LOG2E
from kernels_src.sparse_bwd import DQ_ROW_PAD, ENTRY_TABLE
from kernels_src.tiles import (acc_rows_cols, copy_row, copy_word, cp_async_rows, cp_async_word, item_word, row_table,
                               smem_tile, stage_item_words, tile_storage, transposed, warp_mma)
from kernels_src.work_items import item_slice


class SparseBackward:
    def __init__(self, config):
        self.cfg = config
        self.dtype = DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.block_size = config.block_size
        self.tile_n = config.tile_n
        self.halves = config.block_size // config.tile_n
        self.group = config.group
        self.tile_m = config.tile_m
        self.tile_queries = config.tile_m // config.group
        self.threads = config.threads
        self.stages = config.stages
        # dq rows stored, not added, and the item's dk / dv atomics in turn (see the module docstring); the tensor
        # named dq_acc below is then dq_part (E, G D).
        self.deterministic = bool(getattr(config, "deterministic", 0))
        # Warp-specialised (producer.py): a producer warpgroup beside the threads above gathers every tile's rows.
        self.ws = False
        self.block_threads = config.threads
        self.traced: dict = {}

    # ------------------------------------------------------------------ host side

    def _smem_layout(self, shape):
        return smem_tile(self.dtype, shape)

    def _mma(self, warps_m: int, warps_n: int):
        return warp_mma(self.dtype, warps_m, warps_n)

    # Threads per row of the row copies (tiles.cp_async_rows; None: a 16-byte chunk each), by measurement per
    # kernel class: fewer, longer rows per thread where registers allow.
    ROW_THREADS = None

    def _gmem_copy(self):
        return cp_async_rows(self.dtype, self.head_dim, self.threads, self.gather_row_threads())

    def gather_row_threads(self) -> int | None:
        """Threads per gathered row of the mma.sync kernels: ROW_THREADS, and at D 256 8 (2 rows a thread, as the
        wgmma kernels take there): with a 16-byte chunk each (8 rows a thread) sparse_bwd spilled 32 bytes at
        G = 16 (ptxas)."""
        return 8 if self.ROW_THREADS is None and self.head_dim > 128 else self.ROW_THREADS

    def occupancy(self) -> dict:
        """Launch bounds beyond the block size: with a producer (setmaxnreg), one CTA per SM, so that ptxas knows
        the registers at the kernel's entry (.minnctapersm; without it setmaxnreg is ignored, C7508)."""
        return dict(min_blocks_per_mp=1) if self.ws else {}

    def _gmem_copy_producer(self):
        """The producer warpgroup's row copies (producer.py; built and unused without one)."""
        return cp_async_rows(self.dtype, self.head_dim, 128, self.ROW_THREADS)

    def rows_cols(self, t: cute.Tensor) -> cute.Tensor:
        """The rows x columns one thread holds of an accumulator (or of its coordinates)."""
        return acc_rows_cols(t)

    def _score_mma(self):
        """The MMA of the (rows x keys) products and of dQ = dS K: warps 4 x 2 of mma.sync."""
        return self._mma(4, 2)

    def _kv_mma(self):
        """The MMA of the (keys x D) products dV += P^T dO, dK += dS^T Q: warps 4 x 2 of mma.sync."""
        return self._mma(4, 2)

    @cute.jit
    def publish_async_copies(self):
        """Between a thread's shared-memory writes (cp.async completed, or P / dS stored) and the barrier before
        the MMAs read them: nothing for ldmatrix (generic proxy); the wgmma subclasses fence them into the async
        proxy."""
        pass

    def dq_pieces(self) -> int:
        """Column pieces of the dQ (dq_p) product, formed and staged one after another: at D 256 two, so that the
        mma.sync kernels hold 64 rather than 128 registers of it beside dK and dV (at 128 they spilled: sparse_bwd
        96 bytes at G = 16, sparse_bwd_proxy 48 at G >= 2, ptxas). The wgmma kernels take it whole."""
        return 2 if self.head_dim > 128 else 1

    @cute.jit
    def wait_products(self, pending: cutlass.Constexpr):
        """Until at most `pending` of the products issued with gemm(wait=False) are in flight: nothing for
        mma.sync (synchronous); the wgmma subclasses wait on their commit groups."""
        pass

    def _row_floats(self):
        """The staged row scalars: (tile row, stage, lse | delta)."""
        return row_table(self.tile_m, self.stages, 2)

    def _dq_query_layout(self):
        """The main kernel's dq staging rows (tile_m x D): row g * queries + qi (row_query, row_head) at
        qi * (G D + pad) + g D, so that a query's G rows are one contiguous bulk reduction (64 per tile became
        64 // G: their issue, serialised per warp, held the other warps at the next barrier; NOTES.md). The eight
        rows of a warp's accumulator store are eight queries, one pad apart: 2-way bank conflicts, as with a pad
        per row."""
        g, d = self.group, self.head_dim
        return cute.make_layout(((self.tile_queries, g), d), stride=((g * d + DQ_ROW_PAD, d), 1))

    def _dq_layout(self):
        return cute.make_layout((self.tile_m, self.head_dim), stride=(self.head_dim + DQ_ROW_PAD, 1))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                 delta: cute.Tensor, entry_query: cute.Tensor, items: cute.Tensor, dq_acc: cute.Tensor,
                 dk_acc: cute.Tensor, dv_acc: cute.Tensor, scale: cutlass.Float32, hp: cutlass.Int32,
                 hp_per_hk: cutlass.Int32, stream: cuda.CUstream):
        self.launch(q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, None, scale, hp,
                    hp_per_hk, stream)

    @cute.jit
    def call_tau(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                 delta: cute.Tensor, entry_query: cute.Tensor, items: cute.Tensor, dq_acc: cute.Tensor,
                 dk_acc: cute.Tensor, dv_acc: cute.Tensor, tau: cute.Tensor, scale: cutlass.Float32,
                 hp: cutlass.Int32, hp_per_hk: cutlass.Int32, stream: cuda.CUstream):
        """The entry of the tau_out = 1 variants: __call__ plus the tau rows it writes (export_tau)."""
        self.launch(q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, tau, scale, hp,
                    hp_per_hk, stream)

    @cute.jit
    def call_det(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
                 delta: cute.Tensor, entry_query: cute.Tensor, items: cute.Tensor, dq_part: cute.Tensor,
                 dk_acc: cute.Tensor, dv_acc: cute.Tensor, tau: cute.Tensor, entry_dest: cute.Tensor,
                 item_prev: cute.Tensor, item_done: cute.Tensor, scale: cutlass.Float32, hp: cutlass.Int32,
                 hp_per_hk: cutlass.Int32, stream: cuda.CUstream):
        """The entry of the deterministic variants: call_tau with dq rows stored to dq_part, and the items' turns."""
        self.launch(q, k, v, dout, lse, delta, entry_query, items, dq_part, dk_acc, dv_acc, tau, scale, hp,
                    hp_per_hk, stream, (entry_dest, item_prev, item_done))

    @cute.jit
    def launch(self, q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, tau, scale, hp,
               hp_per_hk, stream, turns=None):
        l_kv = self._smem_layout((self.tile_n, self.head_dim))
        l_rows = self._smem_layout((self.tile_m, self.head_dim, self.stages))
        l_p = self._smem_layout((self.tile_m, self.tile_n))
        l_dq = self._dq_query_layout()
        l_rows_f = self._row_floats()

        SharedStorage = self.shared_storage(l_kv, l_rows, l_p, l_dq, l_rows_f)
        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        layouts = (l_kv, l_rows, l_p, l_dq, l_rows_f, self._gmem_copy(), SharedStorage)
        grid = (items.shape[0] * self.halves, 1, 1)
        if cutlass.const_expr(tau is None):
            self.kernel(q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, scale, hp, hp_per_hk,
                        *layouts).launch(grid=grid, block=(self.threads, 1, 1), smem=self.traced["smem_bytes"],
                                         stream=stream)
        elif cutlass.const_expr(turns is not None):
            self.kernel_det(q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, tau, *turns,
                            scale, hp, hp_per_hk, *layouts).launch(grid=grid, block=(self.threads, 1, 1),
                                                                   smem=self.traced["smem_bytes"], stream=stream)
        else:
            self.kernel_tau(q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, tau, scale, hp,
                            hp_per_hk, *layouts, self._gmem_copy_producer()).launch(
                grid=grid, block=(self.block_threads, 1, 1), smem=self.traced["smem_bytes"], stream=stream,
                **self.occupancy())

    def shared_storage(self, l_kv, l_rows, l_p, l_dq, l_rows_f):
        """The kernel's shared memory (a plain method: CuTeDSL rewrites the control flow of jit functions, which
        would hide the conditional fields from the class body)."""

        @cute.struct
        class SharedStorage:
            if self.ws:  # the producer's full / empty mbarriers per stage, before the 1024-aligned tiles
                full: cute.struct.MemRange[cutlass.Int64, self.stages]
                empty: cute.struct.MemRange[cutlass.Int64, self.stages]
            s_k: tile_storage(self.dtype, l_kv)
            s_v: tile_storage(self.dtype, l_kv)
            s_q: tile_storage(self.dtype, l_rows)
            s_do: tile_storage(self.dtype, l_rows)
            s_p: tile_storage(self.dtype, l_p)
            s_ds: tile_storage(self.dtype, l_p)
            s_dq: tile_storage(cutlass.Float32, l_dq)
            s_entries: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, ENTRY_TABLE], 1024]
            s_rows: tile_storage(cutlass.Float32, l_rows_f)
        return SharedStorage

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(self, q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc,
               scale: cutlass.Float32, hp: cutlass.Int32, hp_per_hk: cutlass.Int32,
               l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout, l_p: cute.ComposedLayout, l_dq: cute.Layout,
               l_rows_f: cute.Layout, gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        self.backward(q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, None, scale, hp,
                      hp_per_hk, l_kv, l_rows, l_p, l_dq, l_rows_f, gcopy, SharedStorage)

    @cute.kernel
    def kernel_tau(self, q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, tau,
                   scale: cutlass.Float32, hp: cutlass.Int32, hp_per_hk: cutlass.Int32,
                   l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout, l_p: cute.ComposedLayout,
                   l_dq: cute.Layout, l_rows_f: cute.Layout, gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
                   gcopy_producer: cute.TiledCopy):
        self.backward(q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, tau, scale, hp,
                      hp_per_hk, l_kv, l_rows, l_p, l_dq, l_rows_f, gcopy, SharedStorage,
                      gcopy_producer=gcopy_producer)

    @cute.kernel
    def kernel_det(self, q, k, v, dout, lse, delta, entry_query, items, dq_part, dk_acc, dv_acc, tau, entry_dest,
                   item_prev, item_done, scale: cutlass.Float32, hp: cutlass.Int32, hp_per_hk: cutlass.Int32,
                   l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout, l_p: cute.ComposedLayout,
                   l_dq: cute.Layout, l_rows_f: cute.Layout, gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr):
        self.backward(q, k, v, dout, lse, delta, entry_query, items, dq_part, dk_acc, dv_acc, tau, scale, hp,
                      hp_per_hk, l_kv, l_rows, l_p, l_dq, l_rows_f, gcopy, SharedStorage,
                      (entry_dest, item_prev, item_done))

    @cute.jit
    def backward(self, q, k, v, dout, lse, delta, entry_query, items, dq_acc, dk_acc, dv_acc, tau,
                 scale: cutlass.Float32, hp: cutlass.Int32, hp_per_hk: cutlass.Int32,
                 l_kv: cute.ComposedLayout, l_rows: cute.ComposedLayout, l_p: cute.ComposedLayout, l_dq: cute.Layout,
                 l_rows_f: cute.Layout, gcopy: cute.TiledCopy, SharedStorage: cutlass.Constexpr, turns=None,
                 gcopy_producer=None):
        """The kernel body; tau None (trace time): the variant without tau_out; turns (entry_dest, item_prev,
        item_done): the deterministic variant's. Warp-specialised (self.ws, producer.py): threads past
        self.threads are the producer warpgroup, which gathers every tile's rows with gcopy_producer into stage
        tile % stages and arrives on full[stage]; the others consume, and free a stage on empty[stage]."""
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        w = cta // self.halves
        n_entries = items[w, 3]
        if n_entries > 0:
            # This CTA's keys: one tile_n slice of the item's key block (both slices see every row of the item).
            b, p, start, t0 = item_slice(items, w, cta, self.halves, hp, self.block_size, self.tile_n)
            kvh = p // hp_per_hk
            seqlen = k.shape[1]  # Sk >= S keys: query row i sits at key position i + Sk - S
            storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
            s_k = storage.s_k.get_tensor(l_kv.outer, swizzle=l_kv.inner)
            s_v = storage.s_v.get_tensor(l_kv.outer, swizzle=l_kv.inner)
            s_q_all = storage.s_q.get_tensor(l_rows.outer, swizzle=l_rows.inner)
            s_do_all = storage.s_do.get_tensor(l_rows.outer, swizzle=l_rows.inner)
            s_p = storage.s_p.get_tensor(l_p.outer, swizzle=l_p.inner)
            s_ds = storage.s_ds.get_tensor(l_p.outer, swizzle=l_p.inner)
            s_dq = storage.s_dq.get_tensor(l_dq)
            s_entries = storage.s_entries.get_tensor(cute.make_layout(ENTRY_TABLE))
            s_rows = storage.s_rows.get_tensor(l_rows_f)

            full = empty = None
            if cutlass.const_expr(self.ws):
                full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
                if tidx == 0:
                    for s in cutlass.range_constexpr(self.stages):
                        cute.arch.mbarrier_init(full + s, self.block_threads - self.threads)  # the producer's
                        # threads, each once its copies have landed (cp.async.mbarrier.arrive.noinc)
                        cute.arch.mbarrier_init(empty + s, self.threads)  # every consumer thread
                cute.arch.mbarrier_init_fence()

            # The item's entries first, in a group of their own: tile 0's gathers need them.
            if tidx < self.threads:
                stage_item_words(entry_query, s_entries, start, n_entries, tidx, self.threads)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(not self.ws):
                self.load_block(gcopy, k[b, None, kvh, None], s_k, t0, seqlen, tidx)
                self.load_block(gcopy, v[b, None, kvh, None], s_v, t0, seqlen, tidx)
            cute.arch.cp_async_wait_group(0)  # the entries' group (the key block is not committed yet)
            cute.arch.sync_threads()
            if cutlass.const_expr(self.ws):
                # Registers move from the producer warpgroup to the consumers (setmaxnreg, per warpgroup): an SM
                # sub-partition's 16K registers hold one producer and two consumer warps.
                if tidx >= self.threads:
                    cute.arch.warpgroup_reg_dealloc(self.PRODUCER_REGS)
                    self.produce(gcopy_producer, q, dout, lse, delta, s_q_all, s_do_all, s_rows, b, p, entry_query,
                                 s_entries, start, n_entries, full, empty, tidx - self.threads)
                else:
                    cute.arch.warpgroup_reg_alloc(self.CONSUMER_REGS)
                    self.load_block(gcopy, k[b, None, kvh, None], s_k, t0, seqlen, tidx)
                    self.load_block(gcopy, v[b, None, kvh, None], s_v, t0, seqlen, tidx)
                    cute.arch.cp_async_commit_group()
                    self.consume(q, dout, lse, delta, entry_query, dq_acc, dk_acc, dv_acc, tau, scale, b, p, kvh, t0,
                                 seqlen, s_k, s_v, s_q_all, s_do_all, s_p, s_ds, s_dq, s_entries, s_rows, gcopy,
                                 start, n_entries, w, tidx, turns, full, empty)
            else:
                self.consume(q, dout, lse, delta, entry_query, dq_acc, dk_acc, dv_acc, tau, scale, b, p, kvh, t0,
                             seqlen, s_k, s_v, s_q_all, s_do_all, s_p, s_ds, s_dq, s_entries, s_rows, gcopy, start,
                             n_entries, w, tidx, turns, full, empty)

    @cute.jit
    def consume(self, q, dout, lse, delta, entry_query, dq_acc, dk_acc, dv_acc, tau, scale, b, p, kvh, t0, seqlen,
                s_k, s_v, s_q_all, s_do_all, s_p, s_ds, s_dq, s_entries, s_rows, gcopy, start, n_entries, w, tidx,
                turns, full, empty):
        """The item's tiles: products, exponentials, dq reductions, tau, then the key block's dK, dV. Without a
        producer the threads also gather tile t + 1 under tile t; with one (self.ws) they wait on full[stage]
        for tile t's rows, free the stage on empty[stage], and meet at the consumers' named barrier."""
        # Made here: a wgmma TiledMma's runtime state (its accumulate flag) would become kernel parameters.
        mma_s, mma_kv = self._score_mma(), self._kv_mma()
        thr_s = mma_s.get_slice(tidx)
        thr_kv = mma_kv.get_slice(tidx)
        acc_dv = cute.make_rmem_tensor(thr_kv.partition_shape_C((self.tile_n, self.head_dim)), cutlass.Float32)
        acc_dk = cute.make_rmem_tensor(thr_kv.partition_shape_C((self.tile_n, self.head_dim)), cutlass.Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32)
        acc_dp = cute.make_rmem_tensor(thr_s.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32)
        s_mn, dp_mn = self.rows_cols(acc_s), self.rows_cols(acc_dp)
        coord_s = self.rows_cols(thr_s.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        dq_cols = self.head_dim // self.dq_pieces()
        acc_dq = cute.make_rmem_tensor(thr_s.partition_shape_C((self.tile_m, dq_cols)), cutlass.Float32)
        dq_mn = self.rows_cols(acc_dq)
        coord_dq = self.rows_cols(thr_s.partition_C(cute.make_identity_tensor((self.tile_m, dq_cols))))
        scale_log2 = scale * LOG2E
        q_t0 = t0 - (seqlen - q.shape[1])  # the CTA's first key in query rows (the causal mask's unit)
        n_rows = cute.size(s_mn, mode=[0])
        lse2 = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        dlt = cute.make_rmem_tensor((n_rows,), cutlass.Float32)
        key_limit = cute.make_rmem_tensor((n_rows,), cutlass.Int32)
        dq_query = self.staged_query(tidx)

        n_tiles = cute.ceil_div(n_entries, self.tile_queries)
        if cutlass.const_expr(self.ws):
            cute.arch.cp_async_wait_group(0)  # this thread's key-block rows
            self.publish_async_copies()
            self.consumers_sync()
        else:
            self.gather_tile(gcopy, q, dout, lse, delta, s_q_all, s_do_all, s_rows, b, p, entry_query,
                             s_entries, start, n_entries, 0, tidx)
        for tile in cutlass.range(n_tiles, unroll=1):
            n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
            stage = tile % self.stages
            s_q = s_q_all[None, None, stage]
            s_do = s_do_all[None, None, stage]
            if cutlass.const_expr(self.ws):
                cute.arch.mbarrier_wait(full + stage, (tile // self.stages) % 2)
                self.publish_async_copies()  # the producer's cp.async writes -> this warpgroup's wgmma reads
            elif cutlass.const_expr(self.stages == 1):
                cute.arch.cp_async_wait_group(0)  # this tile's rows, gathered after the previous tile's last barrier
                self.publish_async_copies()
                cute.arch.sync_threads()
            else:
                if tile + 1 < n_tiles:
                    self.gather_tile(gcopy, q, dout, lse, delta, s_q_all, s_do_all, s_rows, b, p, entry_query,
                                     s_entries, start, n_entries, tile + 1, tidx)
                else:
                    cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)
                self.publish_async_copies()
                cute.arch.sync_threads()
            self.row_scalars(s_rows, entry_query, s_entries, start, tile, n_q, coord_s, q_t0, lse2, dlt, key_limit)

            # S = Q K^T -> P = exp(S - lse); dP = dO V^T -> dS = P (dP - delta). Rows past n_q: P = dS = 0.
            # The previous tile's dq reductions are issued under the two products: the bulk instructions go
            # out one at a time per SM, and issued at that tile's end they held every other warp at this
            # tile's first barrier (NOTES.md).
            self.gemm(mma_s, thr_s, acc_s, s_q, s_k, tidx, False, False, wait=False)
            self.gemm(mma_s, thr_s, acc_dp, s_do, s_v, tidx, False, False, wait=False)
            if tile > 0:
                self.reduce_dq(dq_acc, s_dq, entry_query, s_entries, start, n_entries, tile - 1, b, p, dq_query,
                               turns)
            self.wait_products(0)
            for r in cutlass.range_constexpr(n_rows):
                for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    pv = cutlass.Float32(0.0)
                    if coord_s[0, c][1] <= key_limit[r]:
                        pv = cute.math.exp2(s_mn[r, c] * scale_log2 - lse2[r], fastmath=True)
                    s_mn[r, c] = pv
                    dp_mn[r, c] = pv * (dp_mn[r, c] - dlt[r])
            self.store_scores(thr_s, acc_s, s_p)
            self.store_scores(thr_s, acc_dp, s_ds)
            self.wait_rows_read(dq_query >= 0)  # the previous tile's dq rows left s_dq (before its rewrite below)
            self.publish_async_copies()  # P and dS, read next by the MMAs
            self.consumers_sync()

            # dQ = dS K (rows x D) first, so that its staging runs under dV += P^T dO and dK += dS^T Q (keys x
            # D, accumulated across the item).
            if cutlass.const_expr(self.dq_pieces() == 1):
                self.gemm(mma_s, thr_s, acc_dq, s_ds, transposed(s_k), tidx, False, True, wait=False)
            else:
                for h in cutlass.range_constexpr(self.dq_pieces()):
                    self.gemm(mma_s, thr_s, acc_dq, s_ds, cute.local_tile(transposed(s_k), (dq_cols, self.tile_n),
                                                                          (h, 0)), tidx, False, True)
                    self.stage_rows(s_dq, dq_mn, self.rows_cols(thr_s.partition_C(cute.local_tile(
                        cute.make_identity_tensor((self.tile_m, self.head_dim)), (self.tile_m, dq_cols), (0, h)))),
                        scale)
            self.gemm(mma_kv, thr_kv, acc_dv, transposed(s_p), transposed(s_do), tidx, True, True, accumulate=True,
                      wait=False)
            self.gemm(mma_kv, thr_kv, acc_dk, transposed(s_ds), transposed(s_q), tidx, True, True,
                      accumulate=True, wait=False)
            self.wait_products(2)
            if cutlass.const_expr(self.dq_pieces() == 1):
                self.stage_rows(s_dq, dq_mn, coord_dq, scale)
            if cutlass.const_expr(tau is not None):
                self.export_tau(tau, s_p, start + tile * self.tile_queries, n_q, tidx)
            self.wait_products(0)
            if cutlass.const_expr(self.ws):
                # This thread is done with the stage (its row scalars read at the top, its warpgroup's products
                # waited for): every consumer arrives, so that each one's reads happen before the refill.
                cute.arch.mbarrier_arrive(empty + stage)
            # The next gather and the next tile's P / dS stores overwrite what this tile read; s_dq is whole.
            self.consumers_sync()
            if cutlass.const_expr(not self.ws and self.stages == 1):
                # One buffer (D 256): the next tile's rows only once every warp is done with this one's (the
                # barrier above); prefetched a tile ahead they would overwrite the rows this tile's products read.
                if tile + 1 < n_tiles:
                    self.gather_tile(gcopy, q, dout, lse, delta, s_q_all, s_do_all, s_rows, b, p, entry_query,
                                     s_entries, start, n_entries, tile + 1, tidx)

        self.reduce_dq(dq_acc, s_dq, entry_query, s_entries, start, n_entries, n_tiles - 1, b, p, dq_query, turns)
        if cutlass.const_expr(turns is not None):
            self.take_turn(turns, w, tidx)
        self.flush_block(mma_kv, thr_kv, acc_dv, dv_acc[b, None, kvh, None], t0, seqlen, cutlass.Float32(1.0))
        self.flush_block(mma_kv, thr_kv, acc_dk, dk_acc[b, None, kvh, None], t0, seqlen, scale)
        if cutlass.const_expr(turns is not None):
            self.end_turn(turns, w, tidx)
        self.wait_rows_done(dq_query >= 0)

    @cute.jit
    def consumers_sync(self):
        """The barrier of the threads that compute: the whole CTA, or without the producer warpgroup a named one."""
        if cutlass.const_expr(self.ws):
            cute.arch.barrier(barrier_id=Bar.CONSUMERS, number_of_threads=self.threads)
        else:
            cute.arch.sync_threads()

    @cute.jit
    def produce(self, gcopy_producer, q, dout, lse, delta, s_q_all, s_do_all, s_rows, b, p, entry_query, s_entries,
                start, n_entries, full, empty, ptidx):
        """The producer warpgroup: tile t's rows and row scalars into stage t % stages once the consumers freed it
        (empty), then full[stage] when this thread's copies have landed (cp.async.mbarrier.arrive.noinc)."""
        n_tiles = cute.ceil_div(n_entries, self.tile_queries)
        for tile in cutlass.range(n_tiles, unroll=1):
            stage = tile % self.stages
            if tile >= self.stages:
                cute.arch.mbarrier_wait(empty + stage, (tile // self.stages + 1) % 2)
            self.gather_tile(gcopy_producer, q, dout, lse, delta, s_q_all, s_do_all, s_rows, b, p, entry_query,
                             s_entries, start, n_entries, tile, ptidx, self.block_threads - self.threads)
            cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)
        cute.arch.cp_async_wait_group(0)  # the warp leaves once its last copies have landed

    def _tau_copy(self):
        """16-byte chunks of the tile's (queries x keys) tau rows, tile_n / 8 threads per row (threads / (tile_n / 8)
        rows per pass, or the tile's queries if fewer): shared P rows -> registers -> global tau rows."""
        per_row = self.tile_n // 8
        rows = min(self.tile_queries, self.threads // per_row)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((rows, per_row), order=(1, 0)),
                                       cute.make_layout((1, 8))), rows * per_row

    @cute.jit
    def export_tau(self, tau, s_p, e0, n_q, tidx):
        """tau[e0 + qi, key] = mean over the G heads g of P[g * Q + qi, key] (tile rows are head-major), for the
        tile's n_q queries: the proxy backward's tau, read from the shared P tile that dV's product reads, in its
        dtype (the sum in fp32). A query's G rows sit in different warps, hence shared memory, not registers."""
        tcopy, n_threads = self._tau_copy()
        if tidx < n_threads:
            queries = self.tile_queries
            thr = tcopy.get_slice(tidx)
            t_c = thr.partition_S(cute.make_identity_tensor((queries, self.tile_n)))
            ptr = cute.make_ptr(self.dtype, tau[e0, None].iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
            t_g = thr.partition_D(cute.make_tensor(ptr, cute.make_layout((queries, self.tile_n),
                                                                         stride=(self.block_size, 1))))
            for m in cutlass.range_constexpr(cute.size(t_g, mode=[1])):
                frag = cute.make_fragment_like(t_g[None, m, None])
                total = cute.make_rmem_tensor(frag.shape, cutlass.Float32)
                for g in cutlass.range_constexpr(self.group):
                    head = thr.partition_S(cute.local_tile(s_p, (queries, self.tile_n), (g, 0)))
                    cute.copy(tcopy, head[None, m, None], frag)
                    if cutlass.const_expr(g == 0):
                        total.store(frag.load().to(cutlass.Float32))
                    else:
                        total.store(total.load() + frag.load().to(cutlass.Float32))
                frag.store((total.load() * (1.0 / self.group)).to(self.dtype))
                if t_c[0, m, 0][0] < n_q:
                    cute.copy(tcopy, frag, t_g[None, m, None])

    @cute.jit
    def reduce_dq(self, dq_acc, s_dq, entry_query, s_entries, start, n_entries, tile, b, p, dq_query, turns=None):
        """dq_acc rows of `tile`'s staged queries += s_dq: one bulk reduction of the query's G head rows per
        issuing thread (dq_query >= 0), as one bulk group. Deterministic: one bulk store of them to the entry's
        slot row of dq_part (turns[0]: entry_dest) instead."""
        if dq_query >= 0:
            if dq_query < cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries):
                nbytes = self.group * self.head_dim * 4
                if cutlass.const_expr(turns is not None):
                    row = turns[0][start + tile * self.tile_queries + dq_query]
                    bulk_store_f32(dq_acc[row, None].iterator.toint(), s_dq[dq_query, None].iterator.toint(), nbytes)
                else:
                    i = item_word(entry_query, s_entries, start, tile * self.tile_queries + dq_query)
                    bulk_reduce_add_f32(dq_acc[b, i, p * self.group, None].iterator.toint(),
                                        s_dq[dq_query, None].iterator.toint(), nbytes)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_scores(self, thr_mma, acc, s_tile):
        """A (rows x keys) fp32 accumulator -> the input dtype -> its place in the swizzled shared tile, with the
        widest stores both layouts allow (a column pair per 32-bit store; one 16-bit store per element before)."""
        frag = cute.make_fragment_like(acc, self.dtype)
        acc_mn, frag_mn = self.rows_cols(acc), self.rows_cols(frag)
        dst_mn = self.rows_cols(thr_mma.partition_C(s_tile))
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):  # a row at a time: fewer live registers
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                frag_mn[r, c] = acc_mn[r, c].to(self.dtype)
            cute.autovec_copy(frag_mn[r, None], dst_mn[r, None])

    @cute.jit
    def row_scalars(self, s_rows, entry_query, s_entries, start, tile, n_q, coord_s, t0, lse2, dlt, key_limit):
        """Per score row r of this thread in `tile`: lse (log2 units) and delta from the tile's staged row scalars,
        and the last visible key of the CTA's keys (the causal limit); a row past the tile's queries gets
        key_limit -1 (nothing visible: it adds nothing)."""
        for r in cutlass.range_constexpr(cute.size(lse2)):
            row = coord_s[r, 0][0]
            qi = self.row_query(row)
            lse2[r] = cutlass.Float32(0.0)
            dlt[r] = cutlass.Float32(0.0)
            key_limit[r] = -1
            if qi < n_q:
                lse2[r] = s_rows[row, tile % self.stages, 0] * LOG2E
                dlt[r] = s_rows[row, tile % self.stages, 1]
                key_limit[r] = item_word(entry_query, s_entries, start, tile * self.tile_queries + qi) - t0

    def row_query(self, row):
        """Tile rows are head-major: row = g * (tile_m // G) + qi for query qi of the tile and head p * G + g."""
        return row % self.tile_queries

    def row_head(self, row):
        return row // self.tile_queries

    @cute.jit
    def staged_query(self, tidx):
        """The tile query whose staged dq rows this thread reduces (threads 0 .. tile_m // G - 1), or -1. The
        issuing threads stay in warp 0: these bulk instructions are issued one at a time per SM, so spreading them
        over the warps only delays all of them (rows spread over eight warps: (b) 64K 35.4 -> 38.8 ms)."""
        q = cutlass.Int32(-1)
        if tidx < self.tile_queries:
            q = tidx
        return q

    @cute.jit
    def stage_rows(self, s_rows, acc_mn, coord, factor):
        """acc (rows x D) * factor -> the fp32 staging tile, fenced for the async proxy (the bulk reductions)."""
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                s_rows[coord[r, 0][0], coord[0, c][1]] = acc_mn[r, c] * factor
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def take_turn(self, turns, w, tidx):
        """Deterministic variants, before item w's key-block atomics: wait until the item before it on the same
        rows (item_prev[w], -1 for none; always a lower item, so already running or done) has raised its flag."""
        _, item_prev, item_done = turns
        prev = item_prev[w]
        if tidx == 0:
            if prev >= 0:
                wait_flag(item_done.iterator.toint() + prev * 4)
        cute.arch.sync_threads()

    @cute.jit
    def end_turn(self, turns, w, tidx):
        """After item w's atomics (every thread's, by the barrier): raise item_done[w] for the item after it."""
        _, _, item_done = turns
        cute.arch.sync_threads()
        if tidx == 0:
            raise_flag(item_done.iterator.toint() + w * 4)

    @cute.jit
    def reduce_row(self, dst, s_rows, row):
        """dst (one fp32 row of D) += s_rows[row], one asynchronous bulk reduction (the caller commits);
        deterministic: dst = s_rows[row], a bulk store."""
        if cutlass.const_expr(self.deterministic):
            bulk_store_f32(dst.iterator.toint(), s_rows[row, None].iterator.toint(), self.head_dim * 4)
        else:
            bulk_reduce_add_f32(dst.iterator.toint(), s_rows[row, None].iterator.toint(), self.head_dim * 4)

    @cute.jit
    def wait_rows_read(self, reduces):
        """The issuing threads (reduces: this thread issues a staged row's bulk reductions) wait until their bulk
        reductions have read shared memory."""
        if reduces:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def wait_rows_done(self, reduces):
        """Before the CTA exits: every bulk reduction this thread issued has completed."""
        if reduces:
            cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def flush_block(self, mma_kv, thr_kv, acc, g_rows, t0, seqlen, factor):
        """acc (keys x D) * factor -> atomics into the fp32 rows t0 + key of one head (keys past S skipped)."""
        acc_mn = self.rows_cols(acc)
        cols = cute.size(g_rows, mode=[1])
        coord = self.rows_cols(thr_kv.partition_C(cute.make_identity_tensor((self.tile_n, cols))))
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            t = t0 + coord[r, 0][0]
            if t < seqlen:
                self.red_row(g_rows[t, None], acc_mn, coord, r, factor)

    @cute.jit
    def red_row(self, dst, acc_mn, coord, r, factor):
        """dst[col] += factor * acc_mn[r, c] for the thread's columns of row r, two adjacent columns per vector
        reduction (the accumulator's column pairs; dst rows are fp32 with 8-byte aligned even columns)."""
        base = dst.iterator.toint()
        for c in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[1]), 2):
            red_add_v2(base + coord[0, c][1] * 4, acc_mn[r, c] * factor, acc_mn[r, c + 1] * factor)

    @cute.jit
    def gemm(self, tiled_mma, thr_mma, acc, s_a, s_b, tidx, trans_a: cutlass.Constexpr, trans_b: cutlass.Constexpr,
             accumulate: cutlass.Constexpr = False, wait: cutlass.Constexpr = True):
        """acc (+)= A B^T with A (M, K) and B (N, K) smem views; trans_*: the view's K mode is not the contiguous
        one (a transposed tile), so ldmatrix.trans reads it. mma.sync is synchronous: wait does not apply."""
        ldsm_a = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=trans_a, num_matrices=4), self.dtype)
        ldsm_b = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=trans_b, num_matrices=4), self.dtype)
        copy_a = cute.make_tiled_copy_A(ldsm_a, tiled_mma).get_slice(tidx)
        copy_b = cute.make_tiled_copy_B(ldsm_b, tiled_mma).get_slice(tidx)
        t_ra = thr_mma.make_fragment_A(thr_mma.partition_A(s_a))
        t_rb = thr_mma.make_fragment_B(thr_mma.partition_B(s_b))
        t_sa, t_sb = copy_a.partition_S(s_a), copy_b.partition_S(s_b)
        t_ra_v, t_rb_v = copy_a.retile(t_ra), copy_b.retile(t_rb)
        if cutlass.const_expr(not accumulate):
            acc.fill(0.0)
        for kk in cutlass.range_constexpr(cute.size(t_ra, mode=[2])):
            cute.copy(copy_a, t_sa[None, None, kk], t_ra_v[None, None, kk])
            cute.copy(copy_b, t_sb[None, None, kk], t_rb_v[None, None, kk])
            cute.gemm(tiled_mma, acc, t_ra[None, None, kk], t_rb[None, None, kk], acc)

    @cute.jit
    def load_block(self, gcopy, g_rows, s_tile, t0, seqlen, tidx):
        """cp.async rows [t0, t0 + tile_n) of one head; rows past the sequence are zero (their dS and P are 0,
        and 0 * garbage could be NaN)."""
        thr = gcopy.get_slice(tidx)
        t_s = thr.partition_D(s_tile)
        t_c = thr.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
            t = t0 + t_c[0, m, 0][0]
            if t < seqlen:
                copy_row(gcopy, self.dtype, g_rows[t, None], t_s, t_c, m)
            else:
                t_s[None, m, None].fill(0)

    @cute.jit
    def gather_tile(self, gcopy, q, dout, lse, delta, s_q_all, s_do_all, s_rows, b, p, entry_query, s_entries, start,
                    n_entries, tile, tidx, threads: cutlass.Constexpr = 0):
        """cp.async tile row r <- q / dout[b, i, p*G + row_head(r)] with i the item's entry tile * queries +
        row_query(r), into buffer tile % stages, and the row's lse and delta into its row scalars (threads
        0 .. 2 tile_m - 1), as one group; rows past the tile's queries are zero-filled (their scalars are never
        read). threads (the producer warpgroup, producer.py): that many threads copy every row scalar, and rows past
        the tile's queries repeat its first query's rows instead of zeros, so that every write to the stage is a
        cp.async that full[stage] waits for (finite rows: their P and dS are 0 by key_limit, adding nothing)."""
        n_q = cutlass.min(n_entries - tile * self.tile_queries, self.tile_queries)
        buf = tile % self.stages
        thr = gcopy.get_slice(tidx)
        t_c = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        t_sq = thr.partition_D(s_q_all[None, None, buf])
        t_sdo = thr.partition_D(s_do_all[None, None, buf])
        for m in cutlass.range_constexpr(cute.size(t_sq, mode=[1])):
            row = t_c[0, m, 0][0]
            qi = self.row_query(row)
            if qi < n_q:
                i = item_word(entry_query, s_entries, start, tile * self.tile_queries + qi)
                h = p * self.group + self.row_head(row)
                copy_row(gcopy, self.dtype, q[b, i, h, None], t_sq, t_c, m)
                copy_row(gcopy, self.dtype, dout[b, i, h, None], t_sdo, t_c, m)
            else:
                if cutlass.const_expr(threads == 0):
                    t_sq[None, m, None].fill(0)
                    t_sdo[None, m, None].fill(0)
                else:
                    i = item_word(entry_query, s_entries, start, tile * self.tile_queries)
                    h = p * self.group + self.row_head(row)
                    copy_row(gcopy, self.dtype, q[b, i, h, None], t_sq, t_c, m)
                    copy_row(gcopy, self.dtype, dout[b, i, h, None], t_sdo, t_c, m)
        if cutlass.const_expr(threads == 0 or threads >= 2 * self.tile_m):  # one word per thread
            self.gather_word(lse, delta, s_rows, b, p, entry_query, s_entries, start, tile, n_q, buf, tidx)
        else:  # fewer `threads` than row scalars copy them all
            for e in cutlass.range_constexpr(0, 2 * self.tile_m, threads):
                self.gather_word(lse, delta, s_rows, b, p, entry_query, s_entries, start, tile, n_q, buf, e + tidx)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def gather_word(self, lse, delta, s_rows, b, p, entry_query, s_entries, start, tile, n_q, buf, e):
        """Row scalar e of the tile (e < tile_m: lse of row e, else delta of row e - tile_m), one 4-byte cp.async."""
        row = e % self.tile_m
        qi = self.row_query(row)
        if e < 2 * self.tile_m:
            if qi < n_q:
                i = item_word(entry_query, s_entries, start, tile * self.tile_queries + qi)
                h = p * self.group + self.row_head(row)
                word = cp_async_word(cutlass.Float32)
                if e < self.tile_m:
                    copy_word(word, lse[b, h, None], i, s_rows, row, buf, 0)
                else:
                    copy_word(word, delta[b, h, None], i, s_rows, row, buf, 1)
