"""The KL pass's merge (CuTeDSL): LANES_PER_ROW lanes per (b, p, i) row, lane l of a row visits its (slot, group)
pairs l, l + LANES_PER_ROW, ... (slot-major, so a row's loads of one round are contiguous triples).

Each lane keeps sum A, sum T and an online log2-sum-exp2 (m, s) of its live pairs' L; the row's lanes then reduce
them by butterflies (xor offsets below LANES_PER_ROW stay inside the row's lanes), the lse's pieces rescaled to the
row's max first. A lane or row without a finite L keeps m = -inf and s = 0, and the rescale of such a piece is
skipped (never exp2(-inf - -inf)). A NaN L (a NaN proxy score) joins no max: it goes into `poison`, a sum that
is 0 or NaN, added to the lse at the end, so the row's lse and KL come out NaN. Every lane of a warp runs the same rounds (the pair count is the same for all
rows), rows past the end included, so the shuffles always see the whole warp.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.constants import LN2
from kernels_src.sparse_combine.kernel import selection_row
from kernels_src.sparse_combine_kl import LANES_PER_ROW

_BUTTERFLY = tuple(LANES_PER_ROW >> (n + 1) for n in range(LANES_PER_ROW.bit_length() - 1))  # 4, 2, 1: a row's lanes


@cute.jit
def _rescaled(s, m, m_to):
    """s * 2^(m - m_to), 0 for an empty piece (m = -inf)."""
    out = cutlass.Float32(0.0)
    if m > -cutlass.Float32.inf:
        out = s * cute.math.exp2(m - m_to, fastmath=True)
    return out


class SparseCombineKL:
    def __init__(self, config):
        self.block_size = config.block_size
        self.threads = config.threads
        self.traced = {"smem_bytes": 0}

    @cute.jit
    def __call__(self, block_indices: cute.Tensor, kl_part: cute.Tensor, lse_proxy: cute.Tensor,
                 kl_rows: cute.Tensor, query_offset: cutlass.Int32, stream: cuda.CUstream):
        B, Hp, S, _ = block_indices.shape
        self.kernel(block_indices, kl_part, lse_proxy, kl_rows, query_offset).launch(
            grid=(cute.ceil_div(B * Hp * S, self.threads // LANES_PER_ROW), 1, 1), block=(self.threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, block_indices, kl_part, lse_proxy, kl_rows, query_offset: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % LANES_PER_ROW
        B, Hp, S, K = block_indices.shape
        groups = kl_part.shape[1] // 3
        row = cta * (self.threads // LANES_PER_ROW) + tidx // LANES_PER_ROW
        live_row = row < B * Hp * S
        row_c = cutlass.min(row, B * Hp * S - 1)  # rows past the end run the rounds on the last row, store nothing
        b, p, i, local = selection_row(row_c, Hp, S, query_offset, self.block_size)
        neg_inf = -cutlass.Float32.inf
        a_sum = cutlass.Float32(0.0)
        t_sum = cutlass.Float32(0.0)
        m = neg_inf
        s = cutlass.Float32(0.0)
        poison = cutlass.Float32(0.0)
        for pair in cutlass.range(lane, K * groups, LANES_PER_ROW, unroll=1):
            k = pair // groups
            c = pair - k * groups
            j = block_indices[b, p, i, k]
            if j >= 0 and j <= local:
                d = cutlass.Int64(row_c) * K + k  # 64-bit: d * 3n passes 2**31 at long S
                a_sum += kl_part[d, 3 * c]
                t_sum += kl_part[d, 3 * c + 1]
                l2 = kl_part[d, 3 * c + 2]
                if l2 > neg_inf:
                    m_new = cute.arch.fmax(m, l2)
                    s = _rescaled(s, m, m_new) + cute.math.exp2(l2 - m_new, fastmath=True)
                    m = m_new
                if l2 != l2:
                    poison = l2
        for off in _BUTTERFLY:
            a_sum += cute.arch.shuffle_sync_bfly(a_sum, offset=off)
            t_sum += cute.arch.shuffle_sync_bfly(t_sum, offset=off)
            poison += cute.arch.shuffle_sync_bfly(poison, offset=off)
        m_row = m
        for off in _BUTTERFLY:
            m_row = cute.arch.fmax(m_row, cute.arch.shuffle_sync_bfly(m_row, offset=off))
        s = _rescaled(s, m, m_row)
        for off in _BUTTERFLY:
            s += cute.arch.shuffle_sync_bfly(s, offset=off)
        if lane == 0 and live_row:
            lse = neg_inf
            if s > 0.0:
                lse = (m_row + cute.math.log2(s, fastmath=True)) * LN2
            lse += poison
            # `!=` is unordered: a NaN A or T (a NaN main score reached tau) makes the KL NaN, not 0.
            kl = poison
            if t_sum != 0.0:
                kl += LN2 * a_sum
                if s > 0.0:
                    kl += lse * t_sum
            lse_proxy[b, p, i] = lse
            kl_rows[b, p, i] = kl
