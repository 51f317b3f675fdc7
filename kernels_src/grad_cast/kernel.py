"""The gradient cast (CuTeDSL): D / 8 lanes per (b, i, h) row; each lane loads its 8 fp32 of the accumulator row
(two 16-byte loads), rounds them to the gradient's dtype and stores 16 bytes. Rows run h fastest, so a warp reads
contiguous accumulator rows and writes whole 32-byte sectors of each gradient row whatever its strides.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.constants import DTYPES


class GradCast:
    def __init__(self, config):
        from kernels_src.grad_cast import ELEMS_PER_LANE, lanes_per_row, rows_per_cta

        self.dtype = DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.threads = config.threads
        self.per_lane = ELEMS_PER_LANE
        self.lanes = lanes_per_row(config)
        self.rows = rows_per_cta(config)
        self.traced = {"smem_bytes": 0}

    @cute.jit
    def __call__(self, acc: cute.Tensor, grad: cute.Tensor, stream: cuda.CUstream):
        B, S, H, _ = acc.shape
        self.kernel(acc, grad).launch(grid=(cute.ceil_div(B * S * H, self.rows), 1, 1),
                                      block=(self.threads, 1, 1), stream=stream)

    @cute.jit
    def _lane_slice(self, dtype: cutlass.Constexpr, row_view, sub):
        """This lane's 8 elements of a row, as a tensor on a 16-byte aligned pointer (vectorised access)."""
        ptr = cute.make_ptr(dtype, row_view.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
        return cute.local_tile(cute.make_tensor(ptr, cute.make_layout(self.head_dim)), (self.per_lane,), (sub,))

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
            x = self._lane_slice(cutlass.Float32, acc[b, i, h, None], sub).load()
            self._lane_slice(self.dtype, grad[b, i, h, None], sub).store(x.to(self.dtype))
