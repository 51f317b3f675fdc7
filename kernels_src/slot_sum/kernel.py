"""The deterministic backward's slot sum (CuTeDSL): one warp per (b, p, i, g) row, lane l owns D/32 contiguous
elements; the live slots' fp32 rows are added in slot order (16-byte loads per lane, 512 coalesced bytes per row)."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.sparse_combine.kernel import RowWarps

class SlotSum(RowWarps):
    @cute.jit
    def __call__(self, block_indices: cute.Tensor, part: cute.Tensor, out: cute.Tensor, query_offset: cutlass.Int32,
                 stream: cuda.CUstream):
        self.kernel(block_indices, part, out, query_offset).launch(
            grid=self.row_grid(block_indices), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, block_indices, part, out, query_offset: cutlass.Int32):
        lane, row, live = self.warp_row(block_indices)
        _, Hp, S, K = block_indices.shape
        if live:
            b, p, i, g, bpi, local = self.row_coords(row, Hp, S, query_offset)
            acc = cute.make_rmem_tensor((self.per_lane,), cutlass.Float32)
            acc.fill(0.0)
            for k in cutlass.range(K, unroll=1):
                j = block_indices[b, p, i, k]
                if j >= 0 and j <= local:
                    d = cutlass.Int64(bpi) * K + k  # 64-bit: d * G * D passes 2**31 at benchmark sizes
                    rows_k = cute.local_tile(part[d, g, None], (self.per_lane,), (lane,)).load()
                    for e in cutlass.range_constexpr(self.per_lane):
                        acc[e] = acc[e] + rows_k[e]
            res = cute.make_rmem_tensor((self.per_lane,), self.dtype)
            for e in cutlass.range_constexpr(self.per_lane):
                res[e] = acc[e].to(self.dtype)
            row_out = out[b, i, p * self.group + g, None]
            ptr = cute.make_ptr(self.dtype, row_out.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
            dst = cute.local_tile(cute.make_tensor(ptr, cute.make_layout(self.head_dim)), (self.per_lane,), (lane,))
            cute.autovec_copy(res, dst)
