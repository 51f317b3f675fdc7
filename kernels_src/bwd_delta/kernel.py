"""The backward's delta (CuTeDSL): D / 8 lanes per (b, i, h) row, each loading 16 bytes of dO and of O (the rows
are 16-byte aligned: the runtime copies views whose strides are not 16-byte multiples), fp32 products, then a
butterfly sum over the row's lanes.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.tiles import RowLanes


class BackwardDelta(RowLanes):
    @cute.jit
    def __call__(self, dout: cute.Tensor, out: cute.Tensor, delta: cute.Tensor, stream: cuda.CUstream):
        B, S, H, _ = dout.shape
        self.kernel(dout, out, delta).launch(grid=(cute.ceil_div(B * S * H, self.rows), 1, 1),
                                             block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, dout, out, delta):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        B, S, H, _ = dout.shape
        row = cta * self.rows + tidx // self.lanes
        sub = tidx % self.lanes
        live = row < B * S * H
        # Rows past the end read row 0 (always present) so that every lane joins the shuffles below.
        r = row if live else 0
        h = r % H
        i = (r // H) % S
        b = r // (H * S)
        a = self.lane_slice(self.dtype, dout[b, i, h, None], sub).load()
        o = self.lane_slice(self.dtype, out[b, i, h, None], sub).load()
        total = cutlass.Float32(0.0)
        for e in cutlass.range_constexpr(self.per_lane):
            total += a[e].to(cutlass.Float32) * o[e].to(cutlass.Float32)
        off = self.lanes // 2
        while off >= 1:  # unrolled at trace time: lanes is a Python int
            total += cute.arch.shuffle_sync_bfly(total, offset=off)
            off //= 2
        if live and sub == 0:
            delta[b, h, i] = total
