"""Merge of the KL pass's per-slot (A, T, L) triples into the proxy lse and the true KL of each (b, p, i) row.

kl_part (E, 3 * n) holds, per entry d = ((b * Hp + p) * S + i) * K + k and key group c of the slot's block, in
log2 units over the group's causal keys: A = sum_t tau (log2 tau - s_p log2 e), T = sum_t tau and
L = log2 sum_t 2^(s_p log2 e) (kernels_src.sparse_kl). Over the live slots (0 <= j = block_indices[b, p, i, k]
<= i // Bs) and all their groups:
  lse_proxy[b, p, i] = ln 2 * log2-sum-exp2 of L,
  kl_rows[b, p, i]   = ln 2 * sum A + lse_proxy * sum T    (ln pi = s_p - lse_p), 0 where sum T = 0,
and a row without a live slot gets lse_proxy = -inf, KL = 0: flash_msa_rt.ops.partials.combine_kl_lse is the
torch statement of the same merge. Row r of the tensors is query query_offset + r (the forward's query chunks).
LANES_PER_ROW lanes per row (four rows per warp), each over the row's (slot, group) pairs l, l + 8, ..., then
butterfly reductions within the row's lanes: one launch in place of ~20 torch ops per chunk ((b) S = 64K: 0.34 ms
against their 1.98, for a 0.3 GB read, under 0.1 ms at 4 TB/s).
With a warp per row, K = 16 one-group slots left half the lanes idle and every row paid five butterfly rounds of
four values: issue-bound (Nsight Compute at (b) 16K: SM 82 %, DRAM 13 %).
This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, variant_name
from kernels_src import matrix
from kernels_src.spec import DEFAULT, BuildSpec, family_spec, refusal, verdict

OP = "sparse_combine_kl"

BLOCK_SIZES = (64, 128)
WARPS = 8
LANES_PER_ROW = 8
ROWS_PER_CTA = WARPS * 32 // LANES_PER_ROW


@dataclass(frozen=True)
class Config:
    block_size: int = 128  # the live rule's j <= i // Bs; the key groups per slot are kl_part's columns / 3
    threads: int = 32 * WARPS

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """The merge reads fp32 statistics only, so head dim and dtype do not name it; it is built where a sparse
    forward it serves is (a build for a head dim or dtype no forward supports builds no merge either)."""
    from kernels_src import sparse_fwd

    if head_dims and not set(head_dims) & set(sparse_fwd.HEAD_DIMS) or \
            dtypes and not set(dtypes) & set(sparse_fwd.DTYPES):
        return []
    return [Config(block_size=bs) for bs in matrix.any_kernel_block_sizes(head_dims, block_sizes)]


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    return verdict(refusal(config, arch, block_size=BLOCK_SIZES, threads=(32 * WARPS,),
                           notes={"threads": f"{WARPS} warps of {32 // LANES_PER_ROW} rows"}))


def params(config: Config) -> tuple:
    return (
        TensorParam("block_indices", "i32", ("B", "Hp", "S", "K"), ("i64", "i64", "i64", 1), align=4),
        TensorParam("kl_part", "f32", ("E", "C"), ("i64", 1), align=4),
        TensorParam("lse_proxy", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4),
        TensorParam("kl_rows", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4),
        ScalarParam("query_offset", "i32"),  # row r is query query_offset + r
    )


def build_set(config: Config, arch: str) -> str:
    """Every forward with the KL runs it."""
    return DEFAULT


def build_spec(config: Config, arch: str) -> BuildSpec:
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"ceil_div(B * Hp * S, {ROWS_PER_CTA})", "1", "1"),
                       compile_fn="kernels_src.sparse_combine_kl.build:compile", smem_bytes=0)
