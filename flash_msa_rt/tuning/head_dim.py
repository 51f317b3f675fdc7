"""What the main kernels change at the contract's widest heads (D 256): the rules the build (kernels_src.matrix and
the families' configs) and the runtime's tuning both read, so that the variants one builds are the ones the other
launches. Shared memory and registers are the limits; the figures are what kernels_src's smem_bytes and ptxas give
(sm90a allows 232448 bytes of shared memory per CTA, 255 registers per thread)."""

from __future__ import annotations

WIDE_HEAD_DIM = 128  # heads wider than this take the rules below


def wide(head_dim: int) -> bool:
    return head_dim > WIDE_HEAD_DIM


def kernel_block_size(head_dim: int, block_size: int) -> int:
    """The key block the main kernels (forward, KL pass, backward, combine, plans) run for a selection of
    block_size. At D 256 a block of 128 keys cannot be one CTA's: sparse_bwd would hold 128 keys x 256 of dK and dV
    in registers (256 per thread) and its tiles need 370688 bytes of shared memory at one gather stage. So the
    kernels take each selected block of 128 as its two 64-key halves (flash_msa_rt.ops.block_split), where a CTA
    holds 64 x 256 (128 registers, as at D 128 with blocks of 128); the plan drops a half with no causal key."""
    return 64 if wide(head_dim) else block_size


def gather_stages(head_dim: int, stages: int) -> int:
    """Gathered-row buffers of the backward kernels and the lockstep KL pass: at D 256 one (two take 288768 bytes
    of shared memory in sparse_bwd and sparse_kl against 232448; one takes 223232)."""
    return 1 if wide(head_dim) else stages


def row_threads(head_dim: int, group: int) -> int | None:
    """Threads per gathered row of sparse_bwd (wgmma; None: one 16-byte chunk each, D / 8 threads). At D <= 128:
    8 at G <= 4, 16 above (measured: kernels_src/sparse_bwd/wgmma.py). At D 256, 8 at every G: 32 threads per row
    at G = 16 spill 40-48 bytes (tau_out 1 / 0), 8 build at 225-236 registers with no spill."""
    return 8 if group <= 4 or wide(head_dim) else None


def forward_stages(head_dim: int, group: int) -> int:
    """q tile buffers of the ping-pong forward: one at G >= 2 (two CTAs per SM; measured in tuning.sparse_fwd), two
    at G = 1 and at D 256, where one buffer's kernel needs 158 registers against the 128 two CTAs allow (ptxas
    C7602)."""
    return 1 if group >= 2 and not wide(head_dim) else 2
