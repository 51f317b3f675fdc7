"""The gradient cast (CuTeDSL): D / 8 lanes per (b, i, h) row; each lane loads its 8 fp32 of the accumulator row
(two 16-byte loads), rounds them to the gradient's dtype and stores 16 bytes. Rows run h fastest, so a warp reads
contiguous accumulator rows and writes whole 32-byte sectors of each gradient row whatever its strides.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.tiles import RowLanes


class GradCast(RowLanes):
    @cute.jit
    def __call__(self, acc: cute.Tensor, grad: cute.Tensor, stream: cuda.CUstream):
        B, S, H, _ = acc.shape
        self.kernel(acc, grad).launch(grid=(cute.ceil_div(B * S * H, self.rows), 1, 1),
                                      block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, acc, grad):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        B, S, H, _ = acc.shape
        row = cta * self.rows + tidx // self.lanes
        if row < B * S * H:
            sub = tidx % self.lanes
            h = row % H
            i = (row // H) % S
            b = row // (H * S)
            x = self.lane_slice(cutlass.Float32, acc[b, i, h, None], sub).load()
            self.lane_slice(self.dtype, grad[b, i, h, None], sub).store(x.to(self.dtype))
