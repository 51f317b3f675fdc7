"""Proxy block scores kernel (CuTeDSL): TMA loads + warp-level mma.sync, one source for sm90a and sm100a.

Per CTA: one (query tile of tile_m rows, proxy head p, batch b).
  1. warp 0 TMA-loads the Q tile once and the first `stages` K blocks of proxy key head p // group;
  2. for each key block j the tile's rows can see: S = Q K_j^T (fp32) with ldmatrix + mma.sync 16x8x16,
     causal mask on blocks that straddle the diagonal, row max, times scale, one store per (row, block);
     the freed K buffer is refilled with block j + stages while the row maxes are reduced and stored;
  3. every later block of the tile's rows gets -inf.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from kernels_src.block_scores import Config, swizzle_bytes
from kernels_src.constants import DTYPES
from kernels_src.tiles import acc_rows_cols, tile_storage

_ATOM_KIND = {128: warpgroup.SmemLayoutAtomKind.K_SW128, 64: warpgroup.SmemLayoutAtomKind.K_SW64}


@dataclasses.dataclass
class ScoreTiles:
    """Trace-time handles of one CTA's score pipeline (smem barriers, TMA partitions, MMA operands, acc). The
    ldmatrix fields are the mma.sync kernels'; the wgmma kernels leave them None."""

    q_full: object
    k_full: object
    tma_atom_q: object
    t_q_g: object
    t_q_s: object
    tma_atom_k: object
    t_k_g: object
    t_k_s: object
    q_bytes: int
    k_bytes: int
    copy_q: object = None
    t_sq: object = None
    t_rq: object = None
    t_rq_view: object = None
    copy_k: object = None
    t_sk: object = None
    t_rk: object = None
    t_rk_view: object = None
    acc: object = None
    acc_mn: object = None
    coord_mn: object = None


class ProxyBlockScores:
    def __init__(self, config: Config):
        self.cfg = config
        self.dtype = DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.block_size = config.block_size
        self.tile_m = config.tile_m
        self.threads = config.threads
        self.stages = config.stages
        self.k_steps = config.head_dim // 16  # mma.sync K is 16
        # Filled at trace time, read back by compile() to check the spec (descriptor basis, shared memory).
        self.traced: dict = {}

    # ------------------------------------------------------------------ host side (traced once per compile)

    def _smem_layouts(self):
        """K-major, swizzled smem for a (rows, Dp) tile: what TMA writes and what ldmatrix / wgmma read.

        The 128B swizzle atom is 8 rows x 64 bf16 (128 bytes); Dp = 128 is two atoms side by side, so TMA boxes are
        64 elements wide and each tile takes Dp / 64 copies. Conflict-free ldmatrix comes from the same swizzle.
        An e4m3 row at Dp 64 is 64 bytes, narrower than the 128B atom: those tiles take the 64B atom
        (kernels_src.block_scores.swizzle_bytes, which the TMA descriptors declare too).
        """
        kind = _ATOM_KIND[swizzle_bytes(self.cfg.dtype, self.head_dim)]
        atom = warpgroup.make_smem_layout_atom(kind, self.dtype)
        s_q = cute.tile_to_shape(atom, (self.tile_m, self.head_dim), (0, 1))
        s_k = cute.tile_to_shape(atom, (self.block_size, self.head_dim, self.stages), (0, 1, 2))
        return s_q, s_k

    @staticmethod
    def _as_bshd(layout: cute.ComposedLayout) -> cute.ComposedLayout:
        """View a (rows, Dp[, stage]) smem layout as (1, rows, 1, Dp[, stage]) to match the (B, S, H, Dp) tensors.

        TMA atoms are built over the user's 4-mode tensors as they are, so that the coordinate tensor CuTeDSL
        passes beside each descriptor holds (B, S, H) in the tensor's own mode order. The unit modes cost nothing.
        """
        o = layout.outer
        shape = (1, o.shape[0], 1, o.shape[1]) + tuple(o.shape[2:])
        stride = (0, o.stride[0], 0, o.stride[1]) + tuple(o.stride[2:])
        return cute.make_composed_layout(layout.inner, 0, cute.make_layout(shape, stride=stride))

    def host_setup(self, q_proxy: cute.Tensor, k_proxy: cute.Tensor):
        """Smem layouts, the two TMA atoms and the tiled MMA: everything a score-tile kernel needs from the host."""
        s_q_layout, s_k_layout = self._smem_layouts()
        s_q4, s_k4 = self._as_bshd(s_q_layout), self._as_bshd(s_k_layout)

        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q_proxy, s_q4, (1, self.tile_m, 1, self.head_dim)
        )
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), k_proxy, s_k4, (1, self.block_size, 1, self.head_dim)
        )
        # The atoms' MLIR types spell the descriptor CuTeDSL will encode (tma_gbasis); compile() checks them.
        self.traced["swizzle"] = str(s_q_layout.inner)
        self.traced["tma_q"] = str(tma_atom_q._trait.value.type)
        self.traced["tma_k"] = str(tma_atom_k._trait.value.type)

        return s_q_layout, s_k_layout, tma_atom_q, tma_q, tma_atom_k, tma_k, self.score_mma()

    def score_mma(self):
        """The score tiles' tiled MMA. Warps tile M only: each warp owns tile_m / warps rows against all Bs keys
        of a block, so a row's maxima need just a quad shuffle. N = 16 per step lets one ldmatrix.x4 feed two n8
        MMAs."""
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (self.threads // 32, 1, 1),
            permutation_mnk=(self.threads // 32 * 16, 16, 16),
        )

    @cute.jit
    def __call__(
        self,
        q_proxy: cute.Tensor,  # (B, S, Hp, Dp)
        k_proxy: cute.Tensor,  # (B, S, Hpk, Dp)
        scores: cute.Tensor,  # (B, Hp, S, NB) f32
        scale: cutlass.Float32,
        group: cutlass.Int32,  # Hp // Hpk
        stream: cuda.CUstream,
    ):
        s_q_layout, s_k_layout, tma_atom_q, tma_q, tma_atom_k, tma_k, tiled_mma = self.host_setup(q_proxy, k_proxy)

        @cute.struct
        class SharedStorage:
            q_full: cute.struct.MemRange[cutlass.Int64, 1]
            k_full: cute.struct.MemRange[cutlass.Int64, self.stages]
            s_q: tile_storage(self.dtype, s_q_layout)
            s_k: tile_storage(self.dtype, s_k_layout)

        smem_bytes = SharedStorage.size_in_bytes()
        self.traced["smem_bytes"] = smem_bytes

        self.kernel(
            q_proxy, k_proxy, scores, scale, group,
            tma_atom_q, tma_q, tma_atom_k, tma_k,
            s_q_layout, s_k_layout, tiled_mma, SharedStorage,
        ).launch(
            grid=(cute.ceil_div(q_proxy.shape[1], self.tile_m), q_proxy.shape[2], q_proxy.shape[0]),
            block=(self.threads, 1, 1),
            smem=smem_bytes,
            stream=stream,
        )

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(
        self,
        q_proxy: cute.Tensor,
        k_proxy: cute.Tensor,
        scores: cute.Tensor,
        scale: cutlass.Float32,
        group: cutlass.Int32,
        tma_atom_q: cute.CopyAtom,
        tma_q: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        tma_k: cute.Tensor,
        s_q_layout: cute.ComposedLayout,
        s_k_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile_rev, p, b = cute.arch.block_idx()
        n_tiles, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        # Causal work grows with the tile index: launch the longest tiles first so they do not form the tail.
        m_block = n_tiles - 1 - tile_rev
        m0 = m_block * self.tile_m
        seqlen = q_proxy.shape[1]
        n_blocks_total = scores.shape[3]
        rows_valid = cutlass.min(self.tile_m, seqlen - m0)
        # Key blocks the tile's last valid row can see; all later blocks are -inf for every row of the tile.
        # (Clamped to NB only so that a wrong NB can never make the kernel store past a row of scores.)
        n_blocks = cutlass.min(cute.ceil_div(m0 + rows_valid, self.block_size), n_blocks_total)
        # Blocks from here on hold keys t > m0 for some rows: they straddle the diagonal and need the mask.
        first_masked = (m0 + 1) // self.block_size

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        t = self.score_tiles(storage, tma_atom_q, tma_q, tma_atom_k, tma_k, s_q_layout, s_k_layout, tiled_mma,
                             tidx, b, m_block, p, p // group)
        self.start_loads(t, tidx, warp_idx, n_blocks)
        quad_lane = tidx % 4

        for j in cutlass.range(n_blocks, unroll=1):
            self.score_block(t, tiled_mma, warp_idx, j, n_blocks)
            if j >= first_masked:
                self.mask_causal(t.acc_mn, t.coord_mn, m0, j * self.block_size)
            self.store_row_max(t.acc_mn, t.coord_mn, scores, scale, b, p, m0, j, seqlen, quad_lane)

        self.fill_neg_inf(scores, b, p, m0, rows_valid, n_blocks, n_blocks_total, tidx)

    # The pieces below are shared with kernels that consume the same score tiles differently (select).

    def score_tiles(self, storage, tma_atom_q, tma_q, tma_atom_k, tma_k, s_q_layout, s_k_layout, tiled_mma,
                    tidx, b, m_block, p, pk) -> "ScoreTiles":
        """Trace-time setup: tma_tiles' handles, the ldmatrix copies feeding the MMAs, and the (tile_m, Bs) fp32
        accumulator with its coordinates."""
        t = self.tma_tiles(storage, tma_atom_q, tma_q, tma_atom_k, tma_k, s_q_layout, s_k_layout, b, m_block, p, pk)
        s_q = storage.s_q.get_tensor(s_q_layout.outer, swizzle=s_q_layout.inner)  # (tile_m, Dp)
        s_k = storage.s_k.get_tensor(s_k_layout.outer, swizzle=s_k_layout.inner)  # (Bs, Dp, stages)

        # Shared -> register copies for the MMA operands (ldmatrix from the swizzled tiles).
        thr_mma = tiled_mma.get_slice(tidx)
        t.t_rq = thr_mma.make_fragment_A(thr_mma.partition_A(s_q))
        t.t_rk = thr_mma.make_fragment_B(thr_mma.partition_B(s_k[None, None, 0]))
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        t.copy_q = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
        t.copy_k = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        t.t_sq, t.t_rq_view = t.copy_q.partition_S(s_q), t.copy_q.retile(t.t_rq)
        t.t_sk, t.t_rk_view = t.copy_k.partition_S(s_k), t.copy_k.retile(t.t_rk)

        t.acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.block_size)), cutlass.Float32)
        t.acc_mn = acc_rows_cols(t.acc)
        # (row, key) coordinates inside one (tile_m, Bs) score tile, in the accumulator's layout.
        t.coord_mn = acc_rows_cols(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.block_size))))
        return t

    def tma_tiles(self, storage, tma_atom_q, tma_q, tma_atom_k, tma_k, s_q_layout, s_k_layout, b, m_block, p,
                  pk) -> "ScoreTiles":
        """The MMA-independent handles: smem barriers and the TMA partitions of this CTA's Q tile and all K blocks
        of (b, pk)."""
        s_q_tma = storage.s_q.get_tensor(self._as_bshd(s_q_layout).outer, swizzle=s_q_layout.inner)
        s_k_tma = storage.s_k.get_tensor(self._as_bshd(s_k_layout).outer, swizzle=s_k_layout.inner)
        g_q = cute.local_tile(tma_q, (1, self.tile_m, 1, self.head_dim), (b, m_block, p, 0))
        t_q_s, t_q_g = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(s_q_tma, 0, 4), cute.group_modes(g_q, 0, 4)
        )
        g_k = cute.local_tile(tma_k, (1, self.block_size, 1, self.head_dim), (b, None, pk, 0))
        t_k_s, t_k_g = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(s_k_tma, 0, 4), cute.group_modes(g_k, 0, 4)
        )
        return ScoreTiles(
            q_full=storage.q_full.data_ptr(),
            k_full=storage.k_full.data_ptr(),
            tma_atom_q=tma_atom_q, t_q_g=t_q_g, t_q_s=t_q_s,
            tma_atom_k=tma_atom_k, t_k_g=t_k_g, t_k_s=t_k_s,
            q_bytes=self.tile_m * self.head_dim * self.dtype.width // 8,  # what one full tile's copies deliver
            k_bytes=self.block_size * self.head_dim * self.dtype.width // 8,
        )

    @cute.jit
    def start_loads(self, t, tidx, warp_idx, n_blocks):
        """Init the mbarriers, then warp 0 loads the Q tile and the first `stages` K blocks."""
        if tidx == 0:
            cute.arch.mbarrier_init(t.q_full, 1)
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(t.k_full + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        # The TMA copy elects one lane itself, so the whole of warp 0 issues it.
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(t.q_full, t.q_bytes)
            cute.copy(t.tma_atom_q, t.t_q_g, t.t_q_s, tma_bar_ptr=t.q_full)
            for s in cutlass.range_constexpr(self.stages):
                if s < n_blocks:
                    self.load_k_block(t.tma_atom_k, t.t_k_g, t.t_k_s, t.k_full, t.k_bytes, s, s)
        cute.arch.mbarrier_wait(t.q_full, 0)

    @cute.jit
    def score_block(self, t, tiled_mma, warp_idx, j, n_blocks):
        """acc = Q K_j^T (unscaled fp32). Ends with every warp past its reads of K stage j % stages, and warp 0
        refilling that stage with block j + stages, so the load overlaps whatever the caller does with acc."""
        stage = j % self.stages
        cute.arch.mbarrier_wait(t.k_full + stage, (j // self.stages) % 2)

        t.acc.fill(0.0)
        cute.copy(t.copy_q, t.t_sq[None, None, 0], t.t_rq_view[None, None, 0])
        cute.copy(t.copy_k, t.t_sk[None, None, 0, stage], t.t_rk_view[None, None, 0])
        for k in cutlass.range_constexpr(self.k_steps):
            if cutlass.const_expr(k + 1 < self.k_steps):
                cute.copy(t.copy_q, t.t_sq[None, None, k + 1], t.t_rq_view[None, None, k + 1])
                cute.copy(t.copy_k, t.t_sk[None, None, k + 1, stage], t.t_rk_view[None, None, k + 1])
            cute.gemm(tiled_mma, t.acc, t.t_rq[None, None, k], t.t_rk[None, None, k], t.acc)

        cute.arch.sync_threads()
        if warp_idx == 0:
            if j + self.stages < n_blocks:
                self.load_k_block(t.tma_atom_k, t.t_k_g, t.t_k_s, t.k_full, t.k_bytes, j + self.stages, stage)

    @cute.jit
    def load_k_block(self, tma_atom_k, t_k_g, t_k_s, k_full, k_bytes, block, stage):
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(k_full + stage, k_bytes)
        cute.copy(tma_atom_k, t_k_g[None, block], t_k_s[None, stage], tma_bar_ptr=k_full + stage)

    @cute.jit
    def mask_causal(self, acc_mn: cute.Tensor, coord_mn: cute.Tensor, m0: cutlass.Int32, t0: cutlass.Int32):
        """Keys t > i do not count: -inf. Also covers keys t >= S of a partial last block (t > i for all i < S)."""
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            key_limit = m0 + coord_mn[r, 0][0] - t0  # last visible key column of this row
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                if coord_mn[0, c][1] > key_limit:
                    acc_mn[r, c] = -cutlass.Float32.inf

    @cute.jit
    def store_row_max(self, acc_mn, coord_mn, scores, scale, b, p, m0, j, seqlen, quad_lane):
        """Row max over the block's keys; a row is spread over a quad of lanes, lane q of the quad stores rows
        r with r % 4 == q, so all 32 lanes store."""
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row_max = acc_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
            row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
            row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=1))
            i = m0 + coord_mn[r, 0][0]
            if quad_lane == r % 4:
                if i < seqlen:
                    scores[b, p, i, j] = row_max * scale  # scale > 0 commutes with max; -inf stays -inf

    @cute.jit
    def fill_neg_inf(self, scores, b, p, m0, rows_valid, n_blocks, n_blocks_total, tidx):
        """Blocks after the last one the tile's rows can see: -inf, row-major over the tile so stores coalesce."""
        width = n_blocks_total - n_blocks
        if width > 0:
            for e in cutlass.range(tidx, rows_valid * width, self.threads, unroll=1):
                r = e // width
                scores[b, p, m0 + r, n_blocks + e - r * width] = -cutlass.Float32.inf
