"""The deterministic backward's query-gradient sum: a query's fp32 partial rows added over its slots in slot order.

The deterministic sparse_bwd / sparse_bwd_proxy variants store each entry's dq (dq_p) rows, G heads x D fp32, at
its slot's row d = ((b * Hp + p) * S + i) * K + k of part (the plan's entry_dest). For each (b, p, i) and head g:
  out[b, i, p*G + g] = sum over the live slots k in order k = 0 .. K-1 of part[d, g]      (fp32, then out's dtype)
with the forward combine's live rule (0 <= j = block_indices[b, p, i, k] <= i // Bs); the rows of dead slots are
never written and never read. A row without a live slot gets 0. Row r of block_indices is query query_offset + r
(the backward runs in query chunks; out is the chunk's view). The order of the additions is fixed, so the result
is bitwise reproducible (flash_msa_rt.ops.sparse_bwd_sums states it in torch).
One warp per (b, p, i, g) row, lane l owns D / 32 contiguous elements (16-byte loads): bound by the read of part.
This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, variant_name
from kernels_src import sparse_combine
from kernels_src import matrix
from kernels_src.spec import DEFAULT, OPT_IN, BuildSpec, family_spec, refusal, verdict

OP = "slot_sum"

ROWS_PER_CTA = sparse_combine.ROWS_PER_CTA  # warps


@dataclass(frozen=True)
class Config:
    """The forward combine's one-head rows (one warp per (b, p, i, g) row, dtype of out, G heads per slot row; G = 1
    for dq_p), and its limits (can_implement). Not sparse_combine.Config: the combine's heads per warp do not
    apply (RowWarps is the one-head layout)."""

    dtype: str = "bf16"
    head_dim: int = 128
    block_size: int = 128
    group: int = 4
    threads: int = 32 * ROWS_PER_CTA

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    dts = tuple(dtypes) if dtypes else sparse_combine.DTYPES
    # dq at D (every G) and dq_p at each Dp the heads serve (group 1), on the kernels' key blocks
    ds = matrix.head_dims(head_dims)
    main = [Config(dtype=dt, head_dim=d, block_size=bs, group=g) for dt in dts for d in ds
            for bs in matrix.kernel_block_sizes(d, block_sizes) for g in sparse_combine.GROUPS]
    proxy = [Config(dtype=dt, head_dim=dp, block_size=bs, group=1) for dt in dts
             for dp in matrix.proxy_head_dims(head_dims)
             for bs in matrix.any_kernel_block_sizes(head_dims, block_sizes)]
    return list(dict.fromkeys(main + proxy))


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    return verdict(refusal(config, arch, dtype=sparse_combine.DTYPES, head_dim=matrix.HEAD_DIMS, block_size=matrix.BLOCK_SIZES,
                           group=sparse_combine.GROUPS, threads=(32 * ROWS_PER_CTA,),
                           notes={"head_dim": "32 lanes x 2 or 4 elements", "threads": "one warp per row"}))


def params(config: Config) -> tuple:
    g, d = config.group, config.head_dim
    return (
        TensorParam("block_indices", "i32", ("B", "Hp", "S", "K"), ("i64", "i64", "i64", 1), align=4),
        TensorParam("part", "f32", ("E", g, d), (g * d, d, 1), align=16),
        TensorParam("out", config.dtype, ("B", "S", "H", d), ("i64", "i64", "i64", 1), align=16),
        ScalarParam("query_offset", "i32"),  # row r is query query_offset + r
    )


def build_set(config: Config, arch: str) -> str:
    """The deterministic backward's sums: its kernels are the wgmma tau path's, so it runs on sm90a only."""
    return DEFAULT if arch == "sm90a" else OPT_IN


def build_spec(config: Config, arch: str) -> BuildSpec:
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"ceil_div(B * Hp * S * {config.group}, {ROWS_PER_CTA})", "1", "1"),
                       compile_fn="kernels_src.slot_sum.build:compile", smem_bytes=0)
