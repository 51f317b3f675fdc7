"""The backward's delta (CuTeDSL): D / 8 lanes per (b, i, h) row, each loading 16 bytes of dO and of O (the rows
are 16-byte aligned: the runtime copies views whose strides are not 16-byte multiples), fp32 products, then a
butterfly sum over the row's lanes.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.constants import DTYPES


class BackwardDelta:
    def __init__(self, config):
        from kernels_src.bwd_delta import ELEMS_PER_LANE, lanes_per_row, rows_per_cta

        self.dtype = DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.threads = config.threads
        self.per_lane = ELEMS_PER_LANE
        self.lanes = lanes_per_row(config)
        self.rows = rows_per_cta(config)
        self.traced = {"smem_bytes": 0}

    @cute.jit
    def __call__(self, dout: cute.Tensor, out: cute.Tensor, delta: cute.Tensor, stream: cuda.CUstream):
        B, S, H, _ = dout.shape
        self.kernel(dout, out, delta).launch(grid=(cute.ceil_div(B * S * H, self.rows), 1, 1),
                                             block=(self.threads, 1, 1), stream=stream)

    @cute.jit
    def _row_slice(self, row_view):
        """This lane's 16 bytes of a row, as a 16-byte aligned tensor (vectorised load)."""
        ptr = cute.make_ptr(self.dtype, row_view.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
        return cute.make_tensor(ptr, cute.make_layout(self.head_dim))

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
        a = cute.local_tile(self._row_slice(dout[b, i, h, None]), (self.per_lane,), (sub,)).load()
        o = cute.local_tile(self._row_slice(out[b, i, h, None]), (self.per_lane,), (sub,)).load()
        total = cutlass.Float32(0.0)
        for e in cutlass.range_constexpr(self.per_lane):
            total += a[e].to(cutlass.Float32) * o[e].to(cutlass.Float32)
        off = self.lanes // 2
        while off >= 1:  # unrolled at trace time: lanes is a Python int
            total += cute.arch.shuffle_sync_bfly(total, offset=off)
            off //= 2
        if live and sub == 0:
            delta[b, h, i] = total
