"""The sparse backward's products on Hopper's warpgroup MMA (wgmma, sm90a only): the `WarpgroupTiles` mixin that
the main backward, the proxy backward and the KL pass share, and the main backward on it.

Tiles of 64 rows x this CTA's keys: the whole 128-key block for sparse_bwd and sparse_bwd_proxy (one CTA per item;
the mma.sync kernels take 64-key slices, two CTAs per item), 64-key slices for the KL pass. Two warpgroups split
the N dimension of every product (atom layout (1, 2, 1)) and read every operand by descriptor:
  - (rows x keys) S = Q K^T, dP = dO V^T (and the proxy's S_g, S_p): m64n(keys/2)k16, Q / dO / K / V K-major
    (tiles.smem_tile), warpgroup w on keys [w keys/2, (w + 1) keys/2);
  - (rows x D) dQ = dS K: the same atoms tiled over D, dS K-major, K^T MN-major (the transposed view of a K-major
    tile is wgmma's canonical MN-major 128B-swizzled layout);
  - (keys x D) dV += P^T dO, dK += dS^T Q: m64n64k16 tiled over the keys, both operands MN-major transposed views,
    accumulated in registers across the item (128 keys: 64 + 64 registers per thread).
The tiled MMAs are made where they are used: a wgmma TiledMma carries its accumulate flag as state, which must not
become a kernel parameter nor outlive the loop body that sets it. Shared-memory writes (cp.async, and the P / dS
stores) reach wgmma through a generic -> async proxy fence before the barrier. Blackwell has no wgmma.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as live objects.
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from flash_msa_rt.tuning.head_dim import row_threads
from kernels_src import wgmma
from kernels_src.sparse_bwd.kernel import SparseBackward
from kernels_src.tiles import WARPGROUP_ROWS, wg_acc_rows_cols

_K, _MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN


class WarpgroupTiles:
    """Mixin over SparseBackward and its subclasses: the wgmma versions of the MMA hooks and of gemm."""

    def _check_wg_tiles(self, family: str):
        if self.tile_m != WARPGROUP_ROWS or self.tile_n not in (64, 128) or self.threads != 256:
            raise ValueError(f"{family} wgmma: tile_m {self.tile_m}, tile_n {self.tile_n}, threads {self.threads}; "
                             f"tile_m 64, tile_n 64 or 128, threads 256 only (two warpgroups)")

    def dq_pieces(self) -> int:
        """The whole dQ product at once (the wgmma kernels build at D 256 without spilling)."""
        return 1

    def gather_row_threads(self) -> int | None:
        """Each wgmma class's own ROW_THREADS, measured per kernel (SparseBackwardWG: tuning.head_dim.row_threads)."""
        return self.ROW_THREADS

    def _wg_mma(self, a_major, b_major, n: int):
        warpgroups = self.threads // 128
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, a_major, b_major, cutlass.Float32,
                                                 (1, warpgroups, 1), (WARPGROUP_ROWS, n // warpgroups))

    def _score_mma(self):
        return self._wg_mma(_K, _K, self.tile_n)

    def _dq_mma(self):
        return self._wg_mma(_K, _MN, self.tile_n)  # same atoms as _score_mma: the same C partition

    def _kv_mma(self):
        return self._wg_mma(_MN, _MN, self.head_dim)

    def rows_cols(self, t: cute.Tensor) -> cute.Tensor:
        return wg_acc_rows_cols(t)

    @cute.jit
    def publish_async_copies(self):
        cute.arch.fence_view_async_shared()

    @cute.jit
    def gemm(self, tiled_mma, thr_mma, acc, s_a, s_b, tidx, trans_a: cutlass.Constexpr, trans_b: cutlass.Constexpr,
             accumulate: cutlass.Constexpr = False, wait: cutlass.Constexpr = True):
        """acc (+)= A B^T, wgmma by descriptor, one commit group, waited for unless wait=False (then the caller
        waits with wait_products before it touches acc). The caller's MMA stands for the product's shape; the
        one issued is made here from (trans_a, trans_b): (no, no) S = Q K^T, (no, yes) dQ = dS K, (yes, yes)
        dK += dS^T Q."""
        if cutlass.const_expr(not trans_a and not trans_b):
            mma = self._score_mma()
        elif cutlass.const_expr(not trans_a and trans_b):
            mma = self._dq_mma()
        elif cutlass.const_expr(trans_a and trans_b):
            mma = self._kv_mma()
        else:
            raise NotImplementedError("wgmma tiles: A^T B^T with a K-major B is not a product of these kernels")
        wgmma.issue_smem(mma, tidx, acc, s_a, s_b, accumulate)
        if cutlass.const_expr(wait):
            warpgroup.wait_group(0)

    @cute.jit
    def wait_products(self, pending: cutlass.Constexpr):
        warpgroup.wait_group(pending)


class SparseBackwardWG(WarpgroupTiles, SparseBackward):
    def __init__(self, config):
        super().__init__(config)
        self._check_wg_tiles("sparse_bwd")
        # Gathered rows: 8 threads each at G <= 4 (against 16: (b) 64K 31.2 -> 30.0 ms, (a) 1.05x, (b) 16K 1.06x;
        # 4 was 6-11 % slower); 16 at G >= 8, where 8 measured 0.98x at (c); 8 at D 256 (the rule's why-comment).
        self.ROW_THREADS = row_threads(self.head_dim, self.group)
