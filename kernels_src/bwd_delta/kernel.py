"""The backward's delta (CuTeDSL): D / 8 lanes per (b, i, h) row, each loading 16 bytes of dO and of O (the rows
are 16-byte aligned: the runtime copies views whose strides are not 16-byte multiples), fp32 products, then a
butterfly sum over the row's lanes. With scale_rows the lanes also write k * dO (k = exp(lse0 - lse), the row's
kept mass under a sink) from the registers they loaded dO into.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.tiles import RowLanes


class BackwardDelta(RowLanes):
    @cute.jit
    def __call__(self, dout: cute.Tensor, out: cute.Tensor, delta: cute.Tensor, stream: cuda.CUstream):
        self.launch(dout, out, delta, None, None, None, stream)

    @cute.jit
    def call_scaled(self, dout: cute.Tensor, out: cute.Tensor, delta: cute.Tensor, lse0: cute.Tensor,
                    lse: cute.Tensor, dout_scaled: cute.Tensor, stream: cuda.CUstream):
        """The entry of the scale_rows = 1 variants."""
        self.launch(dout, out, delta, lse0, lse, dout_scaled, stream)

    @cute.jit
    def launch(self, dout, out, delta, lse0, lse, dout_scaled, stream):
        B, S, H, _ = dout.shape
        self.kernel(dout, out, delta, lse0, lse, dout_scaled).launch(
            grid=(cute.ceil_div(B * S * H, self.rows), 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, dout, out, delta, lse0, lse, dout_scaled):
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
        if cutlass.const_expr(dout_scaled is not None):
            if live:
                # 1 - p_sink; a row with no allowed key (lse0 = -inf) has out = 0 and gets 0, not exp(NaN)
                kept = cutlass.Float32(0.0)
                if lse0[b, h, i] != -cutlass.Float32.inf:
                    kept = cute.math.exp(lse0[b, h, i] - lse[b, h, i])
                frag = cute.make_fragment_like(a)
                frag.store((a.to(cutlass.Float32) * kept).to(self.dtype))
                cute.autovec_copy(frag, self.lane_slice(self.dtype, dout_scaled[b, i, h, None], sub))
