"""fp8 selection's quantisation (CuTeDSL): x (B, S, H, D) bf16 / f16 to e4m3 with power-of-two scales, the
bytes flash_msa_rt.reference.fp8 produces.

Per element: x as fp32 (exact), times 1 / s (a power of two, or 0 / NaN for a non-finite amax: exact), one
rounding to e4m3 (round to nearest even; |x / s| <= 448 so saturation never acts, and a NaN stays NaN). The max
|x| is an integer max over the fp32 bit patterns with the sign cleared: non-negative floats order as their bits,
and every NaN pattern sits above inf above every finite value, so a NaN in a row or block makes its amax NaN (as
torch's aminmax does) without a NaN-aware float max.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.constants import DTYPES

ABS_MASK = 0x7FFFFFFF
INF_BITS = 0x7F800000
NAN_BITS = 0x7FC00000
ONE_BITS = 0x3F800000
E4M3_MAX_EXP = 8  # 448 = 1.75 * 2**8
FRACTION_0875 = 0x600000  # fp32 fraction bits of 1.75: amax's significand above it needs one more power of two


@cute.jit
def as_float(bits: cutlass.Int32) -> cutlass.Float32:
    """The fp32 value of a bit pattern (a register reinterpretation)."""
    cell = cute.make_rmem_tensor((1,), cutlass.Int32)
    cell[0] = bits
    return cute.recast_tensor(cell, cutlass.Float32)[0]


@cute.jit
def abs_max_bits(xf) -> cutlass.Int32:
    """max over the fp32 fragment xf of |x|'s bit pattern (NaN > inf > finite: see the module docstring)."""
    bits = cute.recast_tensor(xf, cutlass.Int32)
    amax = cutlass.Int32(0)
    for e in cutlass.range_constexpr(cute.size(xf)):
        amax = cutlass.max(amax, bits[e] & ABS_MASK)
    return amax


@cute.jit
def power_of_two_scale(amax: cutlass.Int32):
    """(s, 1 / s) as fp32 bit patterns from amax's bits, reference.fp8.power_of_two_scale's rule: s = 2**e with e
    >= -126 the smallest integer such that amax <= 448 * 2**e, 1 where amax is 0, amax itself where it is inf or
    NaN (then 1 / s is 0 or NaN). amax = 1.f * 2**(E - 127) <= 1.75 * 2**(8 + e) from e = E - 127 - 8 while
    f <= .75, one more above it; subnormal amax (E = 0) lands on the floor -126."""
    e = (amax >> 23) - 127 - E4M3_MAX_EXP
    if (amax & 0x7FFFFF) > FRACTION_0875:
        e = e + 1
    e = cutlass.max(e, -126)
    scale_bits = (e + 127) << 23
    inv_bits = (127 - e) << 23
    if amax == 0:
        scale_bits = ONE_BITS
        inv_bits = ONE_BITS
    if amax >= INF_BITS:
        scale_bits = amax
        inv_bits = NAN_BITS
        if amax == INF_BITS:
            inv_bits = 0
    return scale_bits, inv_bits


@cute.jit
def to_e4m3(xf, inv: cutlass.Float32, dst):
    """dst (an e4m3 fragment) = xf * inv rounded once to e4m3."""
    for e in cutlass.range_constexpr(cute.size(xf)):
        xf[e] = xf[e] * inv
    dst.store(xf.load().to(cutlass.Float8E4M3FN))


class _Quantize:
    def __init__(self, config):
        from kernels_src.fp8_quant import ELEMS_PER_LANE, ROWS_PER_LANE, lanes_per_row, rows_per_pass

        self.dtype = DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.block_size = config.block_size
        self.threads = config.threads
        self.per_lane = ELEMS_PER_LANE
        self.lanes = lanes_per_row(config)
        self.rows = rows_per_pass(config)
        self.rows_per_lane = ROWS_PER_LANE
        self.traced = {"smem_bytes": 0}  # what the kernel allocates (the build checks it against the spec)

    @cute.jit
    def _lane_chunk(self, row_view, dtype, align: cutlass.Constexpr, sub):
        """This lane's ELEMS_PER_LANE elements of a row (unit stride), as an aligned tensor (vectorised access)."""
        ptr = cute.make_ptr(dtype, row_view.iterator.toint(), cute.AddressSpace.gmem, assumed_align=align)
        return cute.local_tile(cute.make_tensor(ptr, cute.make_layout(self.head_dim)), (self.per_lane,), (sub,))

    @cute.jit
    def _load(self, x, b, i, h, sub, xf):
        """xf (an fp32 fragment) = this lane's 16 bytes of row x[b, i, h] (exact conversions)."""
        v = self._lane_chunk(x[b, i, h, None], self.dtype, 16, sub).load()
        xf.store(v.to(cutlass.Float32))

    @cute.jit
    def _store(self, x8, b, i, h, sub, xf, inv: cutlass.Float32):
        q = cute.make_rmem_tensor((self.per_lane,), cutlass.Float8E4M3FN)
        to_e4m3(xf, inv, q)
        cute.autovec_copy(q, self._lane_chunk(x8[b, i, h, None], cutlass.Float8E4M3FN, 8, sub))


class QuantizeRows(_Quantize):
    """block_size 1: D / 8 lanes per (b, i, h) row, each quantising its 16 bytes of ROWS_PER_LANE rows (loads
    first, so that both are in flight), the row's max by a butterfly over its lanes."""

    @cute.jit
    def __call__(self, x: cute.Tensor, x8: cute.Tensor, scale: cute.Tensor, stream: cuda.CUstream):
        B, S, H, _ = x.shape
        self.kernel(x, x8, scale).launch(grid=(cute.ceil_div(B * S * H, self.rows * self.rows_per_lane), 1, 1),
                                         block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, x, x8, scale):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        B, S, H, _ = x.shape
        sub = tidx % self.lanes
        xf = cute.make_rmem_tensor((self.rows_per_lane, self.per_lane), cutlass.Float32)
        rows = []  # (row, b, i, h) per u: two integer divisions per row, done once (the loop is unrolled)
        for u in cutlass.range_constexpr(self.rows_per_lane):
            # a pass covers rows consecutive in (b, i, h) order: the CTA's loads are contiguous when x is
            row = (cta * self.rows_per_lane + u) * self.rows + tidx // self.lanes
            # rows past the end read row 0 (always present) so that every lane joins the shuffles below
            r = row if row < B * S * H else 0
            n = r // H
            b = n // S
            rows.append((row, b, n - b * S, r - n * H))
            self._load(x, b, n - b * S, r - n * H, sub, xf[u, None])
        for u in cutlass.range_constexpr(self.rows_per_lane):
            row, b, i, h = rows[u]
            amax = abs_max_bits(xf[u, None])
            off = self.lanes // 2
            while off >= 1:  # unrolled at trace time: lanes is a Python int
                amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
                off //= 2
            scale_bits, inv_bits = power_of_two_scale(amax)
            if row < B * S * H:
                self._store(x8, b, i, h, sub, xf[u, None], as_float(inv_bits))
                if sub == 0:
                    scale[b, i, h] = as_float(scale_bits)


class QuantizeKeyBlocks(_Quantize):
    """block_size Bs: one CTA per (b, key block j, h). Pass p of the block's Bs / rows passes loads row
    j * Bs + p * rows + tidx // lanes, 16 bytes per lane, into registers (rows past S count as zeros and are not
    stored); a warp butterfly and one int32 per warp in shared memory give the block's max; then each lane
    converts and stores what it holds. x is read once."""

    @cute.jit
    def __call__(self, x: cute.Tensor, x8: cute.Tensor, scale: cute.Tensor, stream: cuda.CUstream):
        B, NB, H = scale.shape
        warps = self.threads // 32

        @cute.struct
        class SharedStorage:
            s_warp: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, warps], 16]

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel(x, x8, scale, SharedStorage).launch(grid=(NB * H, B, 1), block=(self.threads, 1, 1),
                                                        smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, x, x8, scale, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        jh, b, _ = cute.arch.block_idx()
        _, S, H, _ = x.shape
        warps = self.threads // 32
        passes = self.block_size // self.rows
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        s_warp = storage.s_warp.get_tensor(cute.make_layout(warps))
        j = jh // H
        h = jh % H
        sub = tidx % self.lanes
        first = j * self.block_size + tidx // self.lanes
        xf = cute.make_rmem_tensor((passes, self.per_lane), cutlass.Float32)
        xf.fill(0.0)
        for p in cutlass.range_constexpr(passes):
            i = first + p * self.rows
            if i < S:
                self._load(x, b, i, h, sub, xf[p, None])
        amax = cutlass.Int32(0)
        for p in cutlass.range_constexpr(passes):
            amax = cutlass.max(amax, abs_max_bits(xf[p, None]))
        for off in (16, 8, 4, 2, 1):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
        if tidx % 32 == 0:
            s_warp[tidx // 32] = amax
        cute.arch.sync_threads()
        for w in cutlass.range_constexpr(warps):
            amax = cutlass.max(amax, s_warp[w])
        scale_bits, inv_bits = power_of_two_scale(amax)
        inv = as_float(inv_bits)
        for p in cutlass.range_constexpr(passes):
            i = first + p * self.rows
            if i < S:
                self._store(x8, b, i, h, sub, xf[p, None], inv)
        if tidx == 0:
            scale[b, j, h] = as_float(scale_bits)
