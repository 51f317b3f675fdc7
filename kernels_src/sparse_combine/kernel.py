"""The sparse forward's combine (CuTeDSL): one warp per (b, p, i) row and heads_per_warp of its heads.

Slots are visited once with an online logsumexp: the running max m, the sum of exp(lse_k - m) and the weighted
partial outputs, rescaled when m grows. A slot's loads are the warp's hw contiguous head rows (hw D 2 bytes,
coalesced; 16-byte loads per lane at the widest). RowWarps (one warp per (b, p, i, g) row) is slot_sum's.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.constants import DTYPES, LN2, LOG2E


def selection_row(bpi, Hp, S, query_offset, block_size: int):
    """(b, p, i, local) of selection row bpi = (b Hp + p) S + i of a (B, Hp, S, K) selection: its batch, proxy
    head, query in the chunk, and the query's own block (query_offset + i) // Bs (the live rule's bound)."""
    i = bpi % S
    bp = bpi // S
    b = bp // Hp
    return b, bp - b * Hp, i, (query_offset + i) // block_size


class RowWarps:
    """A kernel with one warp per (b, p, i, g) row of a (B, Hp, S, K) selection, lane l owning D / 32 contiguous
    elements (this family's combine, slot_sum): the config's fields and the grid that covers every row."""

    def __init__(self, config):
        self.cfg = config
        self.dtype = DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.block_size = config.block_size
        self.group = config.group
        self.threads = config.threads
        self.per_lane = config.head_dim // 32
        self.traced = {"smem_bytes": 0}

    def row_grid(self, block_indices):
        B, Hp, S, _ = block_indices.shape
        return (cute.ceil_div(B * Hp * S * self.group, self.threads // 32), 1, 1)

    def warp_row(self, block_indices):
        """(lane, row, live): this thread's lane, its warp's row of the grid and whether that is a real row."""
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        B, Hp, S, _ = block_indices.shape
        row = cta * (self.threads // 32) + tidx // 32
        return lane, row, row < B * Hp * S * self.group

    def row_coords(self, row, Hp, S, query_offset):
        """(b, p, i, g, bpi, local) of row = bpi G + g, bpi = (b Hp + p) S + i: its batch, proxy head, query (in the
        chunk), head in the group, selection row, and the query's own block (query_offset + i) // Bs."""
        g = row % self.group
        bpi = row // self.group
        b, p, i, local = selection_row(bpi, Hp, S, query_offset, self.block_size)
        return b, p, i, g, bpi, local


class SparseCombine(RowWarps):
    """One warp per (b, p, i) row and heads_per_warp (hw) of its G heads: the warp's share of a slot's partials is
    hw contiguous head rows of o_part, lane l owning elements [l E, (l + 1) E) of them (E = hw D / 32), so head
    g0 + l // (D / E). Each slot's index, lse and rescale then cover E elements of a lane instead of D / 32: the
    one-head-per-warp kernel spent more of its issue slots on them than on the partials (ALU 58 %, DRAM 62 %)."""

    def __init__(self, config):
        super().__init__(config)
        self.heads_per_warp = config.heads_per_warp
        self.warps_per_row = self.group // self.heads_per_warp
        self.per_lane = self.heads_per_warp * self.head_dim // 32
        self.lanes_per_head = self.head_dim // self.per_lane

    def row_grid(self, block_indices):
        B, Hp, S, _ = block_indices.shape
        return (cute.ceil_div(B * Hp * S * self.warps_per_row, self.threads // 32), 1, 1)

    @cute.jit
    def __call__(self, block_indices: cute.Tensor, o_part: cute.Tensor, lse_part: cute.Tensor, out: cute.Tensor,
                 lse: cute.Tensor, query_offset: cutlass.Int32, stream: cuda.CUstream):
        self.kernel(block_indices, o_part, lse_part, out, lse, None, query_offset).launch(
            grid=self.row_grid(block_indices), block=(self.threads, 1, 1), stream=stream)

    @cute.jit
    def call_sinks(self, block_indices: cute.Tensor, o_part: cute.Tensor, lse_part: cute.Tensor, out: cute.Tensor,
                   lse: cute.Tensor, sinks: cute.Tensor, query_offset: cutlass.Int32, stream: cuda.CUstream):
        """The entry of the scale_rows = 1 variants: out also scaled by the head's sink's kept mass."""
        self.kernel(block_indices, o_part, lse_part, out, lse, sinks, query_offset).launch(
            grid=self.row_grid(block_indices), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, block_indices, o_part, lse_part, out, lse, sinks, query_offset: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        B, Hp, S, K = block_indices.shape
        warp = cta * (self.threads // 32) + tidx // 32
        if warp < B * Hp * S * self.warps_per_row:
            bpi = warp // self.warps_per_row
            g = (warp % self.warps_per_row) * self.heads_per_warp + lane // self.lanes_per_head
            t = lane % self.lanes_per_head  # the lane's piece of head g's row
            b, p, i, local = selection_row(bpi, Hp, S, query_offset, self.block_size)
            neg_inf = -cutlass.Float32.inf
            acc = cute.make_rmem_tensor((self.per_lane,), cutlass.Float32)
            acc.fill(0.0)
            m = neg_inf
            total = cutlass.Float32(0.0)
            for k in cutlass.range(K, unroll=1):
                j = block_indices[b, p, i, k]
                if j >= 0 and j <= local:
                    d = cutlass.Int64(bpi) * K + k  # 64-bit: d * G * D passes 2**31 at benchmark sizes
                    part = cute.local_tile(o_part[d, g, None], (self.per_lane,), (t,)).load()
                    l2 = lse_part[d, g] * LOG2E
                    m_new = cute.arch.fmax(m, l2)
                    rescale = cute.math.exp2(m - m_new, fastmath=True)
                    w = cute.math.exp2(l2 - m_new, fastmath=True)
                    total = total * rescale + w
                    for e in cutlass.range_constexpr(self.per_lane):
                        acc[e] = acc[e] * rescale + w * part[e].to(cutlass.Float32)
                    m = m_new
            # total is 0 for a row without live slots (out 0, lse -inf) and NaN when a NaN reached a partial: fmax
            # dropped the NaN lse from m but not from total, and `!=` is unordered (true for NaN), so it reaches
            # out and lse.
            inv = cutlass.Float32(0.0)
            h = p * self.group + g
            if total != 0.0:
                inv = cute.arch.rcp_approx(total)
                if cutlass.const_expr(sinks is not None):
                    # k = 1 / (1 + exp(sink - lse0)) = 1 - p_sink, in log2 units (lse0 = m + log2(total)); a sink
                    # far above lse0 gives exp2 = inf and k = 0 (the true k is below float32's range); a NaN
                    # sink reaches out.
                    over = cute.math.exp2(sinks[h] * LOG2E - m - cute.math.log2(total, fastmath=True),
                                          fastmath=True)
                    inv = inv / (1.0 + over)
            res = cute.make_rmem_tensor((self.per_lane,), self.dtype)
            for e in cutlass.range_constexpr(self.per_lane):
                res[e] = (acc[e] * inv).to(self.dtype)
            row_out = out[b, i, h, None]
            ptr = cute.make_ptr(self.dtype, row_out.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
            dst = cute.local_tile(cute.make_tensor(ptr, cute.make_layout(self.head_dim)), (self.per_lane,), (t,))
            cute.autovec_copy(res, dst)
            if t == 0:
                lse[b, h, i] = neg_inf
                if total != 0.0:
                    lse[b, h, i] = (m + cute.math.log2(total, fastmath=True)) * LN2
