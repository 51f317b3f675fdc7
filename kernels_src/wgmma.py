"""Issuing Hopper's warpgroup MMA (wgmma, sm90a only): the one loop every wgmma kernel here runs per product.

A product is issued as one commit group and not waited for: the caller waits (warpgroup.wait_group) where its
pipeline wants, since ptxas serialises every wgmma whose group is still pending across a loop's back edge (C7514).
The MMA object is made by the caller inside the function that issues: its accumulate flag is per-step state, which
must not outlive that call (and a TiledMma passed into the kernel would carry it as kernel parameters).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def issue(mma, acc, t_ra, t_rb, accumulate: cutlass.Constexpr = False):
    """acc (+)= A B^T over every k16 step of the fragments t_ra (shared-memory descriptors or registers) and t_rb,
    as one commit group. The fence first: the accumulator registers (and a register A operand) may have been
    written since the last products. accumulate=False overwrites acc at the first step."""
    warpgroup.fence()
    for kk in cutlass.range_constexpr(cute.size(t_rb, mode=[2])):
        mma.set(warpgroup.Field.ACCUMULATE, accumulate or kk != 0)
        cute.gemm(mma, acc, t_ra[None, None, kk], t_rb[None, None, kk], acc)
    warpgroup.commit_group()


@cute.jit
def issue_smem(mma, tidx, acc, s_a, s_b, accumulate: cutlass.Constexpr = False):
    """issue() with both operands read by descriptor from the shared-memory tiles s_a (M, K) and s_b (N, K), in
    this thread's slice (tidx: its index in the threads the MMA spans)."""
    thr = mma.get_slice(tidx)
    t_ra = thr.make_fragment_A(thr.partition_A(s_a))
    t_rb = thr.make_fragment_B(thr.partition_B(s_b))
    issue(mma, acc, t_ra, t_rb, accumulate)
