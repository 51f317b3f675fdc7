"""The proxy KL's row math over one key tile, shared by the sparse KL pass (kernels_src.sparse_kl, wgmma kernels)
and the dense warmup KL pass (kernels_src.warmup_kl).

In log2 units (msa-semantics.md, "Proxy KL loss"): with s_p the proxy scores times scale log2 e and tau the main
heads' attention summed over the group, a row's KL needs A = sum tau (log2 tau - s_p), T = sum tau and the
log2-sum-exp2 of s_p over the causal keys; each is a sum over keys, so a tile adds its share. A thread holds
some columns of each of its rows; the four lanes of a quad hold a whole row (the MMA accumulator's layout).
"""

import cutlass
import cutlass.cute as cute

from kernels_src.constants import FLT_MIN


@cute.jit
def scaled_row_max(s_mn, tau_mn, coord, r, key_limit, scale_log2, masked: cutlass.Constexpr):
    """Row r of the proxy scores to log2 units in place (s_p = s scale log2 e); returns their max over the row's
    causal keys (key column <= key_limit), reduced over the quad. In masked tiles tau of the keys t > i is zeroed,
    so that they add nothing to A and T (tau_mn None: the proxy lse alone, no tau)."""
    row_max = -cutlass.Float32.inf
    for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
        sp2 = s_mn[r, c] * scale_log2
        s_mn[r, c] = sp2
        if cutlass.const_expr(not masked):
            row_max = cute.arch.fmax(row_max, sp2)
        elif coord[0, c][1] <= key_limit:
            row_max = cute.arch.fmax(row_max, sp2)
        elif cutlass.const_expr(tau_mn is not None):
            tau_mn[r, c] = 0.0
    row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
    row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=1))
    return row_max


@cute.jit
def kl_row_sums(s_mn, tau_mn, coord, r, key_limit, row_max, masked: cutlass.Constexpr):
    """This thread's share of row r (s_mn in log2 units, from scaled_row_max): (sum of exp2(s_p - row_max) over
    the causal keys, A = sum tau (log2 tau - s_p), T = sum tau)."""
    part = cutlass.Float32(0.0)
    a = cutlass.Float32(0.0)
    t = cutlass.Float32(0.0)
    for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
        sp2 = s_mn[r, c]
        if cutlass.const_expr(not masked):
            part += cute.math.exp2(sp2 - row_max, fastmath=True)
        elif coord[0, c][1] <= key_limit:
            part += cute.math.exp2(sp2 - row_max, fastmath=True)
        ts = tau_mn[r, c]
        # ts = 0 (masked, or underflowed) adds 0, as the contract's "tau = 0 contributes 0"; a sum of normal
        # exp2.ftz results is otherwise >= FLT_MIN, so the clamp changes nothing else.
        a += ts * (cute.math.log2(cute.arch.fmax(ts, FLT_MIN), fastmath=True) - sp2)
        t += ts
    return part, a, t


@cute.jit
def lse_row_part(s_mn, coord, r, key_limit, row_max, masked: cutlass.Constexpr):
    """kl_row_sums' first sum alone (the proxy lse without the KL value): this thread's sum of exp2(s_p - row_max)
    over row r's causal keys, in kl_row_sums' order (so the same bits)."""
    part = cutlass.Float32(0.0)
    for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
        if cutlass.const_expr(not masked):
            part += cute.math.exp2(s_mn[r, c] - row_max, fastmath=True)
        elif coord[0, c][1] <= key_limit:
            part += cute.math.exp2(s_mn[r, c] - row_max, fastmath=True)
    return part
