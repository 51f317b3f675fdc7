"""Merge of the sparse forward's per-block partials into out and lse (the logsumexp combine).

For each (b, p, i) and head g = 0..G-1, over the live slots k (0 <= j = block_indices[b, p, i, k] <= i // Bs) of
the entry d = ((b * Hp + p) * S + i) * K + k:
  lse[b, p*G + g, i] = logsumexp_k lse_part[d, g],
  out[b, i, p*G + g] = sum_k exp(lse_part[d, g] - lse) * o_part[d, g],    (o_part is normalised per block)
A row without a live slot gets out = 0 and lse = -inf. The tensors may hold a chunk of queries: row r is query
i = query_offset + r (for the live rule; out and lse are the chunk's views). The proxy lse comes from the KL pass.
One warp per (b, p, i) row and heads_per_warp of its G heads (lane l owns 16 contiguous elements of those heads'
partial rows at the widest), one pass with an online rescale; the partial buffers are read once (the op is bound
by that read, ~2 bytes per partial element, once each slot's index, lse and rescale are spread over enough
elements: at one head per warp, 4 elements per lane, the ALU pipe limited it; kernels_src/sparse_fwd/NOTES.md).
scale_rows = 1 (attention sinks, flash_msa_rt.ops.sinks): out is also scaled by k = 1 / (1 + exp(sinks[h] - lse))
= 1 - p_sink, the row's kept mass under its head's sink, in the same pass (one rounding), while lse stays the
sink-free one that the KL pass and the backward read: the op's forward then needs no pass over out of its own.
This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, variant_name
from kernels_src import matrix
from kernels_src.spec import DEFAULT, OPT_IN, BuildSpec, family_spec, refusal, verdict

OP = "sparse_combine"

DTYPES = ("bf16", "f16")
GROUPS = (1, 2, 4, 8, 16)
ROWS_PER_CTA = 8  # warps
LANE_ELEMENTS = 16  # the widest a lane's share of a warp's heads gets: two 16-byte loads per slot


def widest_heads(group: int, head_dim: int) -> int:
    """Heads per warp at the widest: as many of the G heads as keep a lane at LANE_ELEMENTS elements or fewer."""
    return max(1, min(group, 32 * LANE_ELEMENTS // head_dim))


@dataclass(frozen=True)
class Config:
    dtype: str = "bf16"
    head_dim: int = 128
    block_size: int = 128
    group: int = 4
    threads: int = 32 * ROWS_PER_CTA
    heads_per_warp: int = 4  # of the row's G heads, one warp's (a divisor of G)
    scale_rows: int = 0  # 1: out scaled by the sink's kept mass (sinks (H,) float32)

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    dts = tuple(dtypes) if dtypes else DTYPES
    ds = matrix.head_dims(head_dims)
    # The widest split ships; one head per warp stays built for A/B runs (sparse_fwd.COMBINE_HEADS_PER_WARP = 1).
    # With sinks (scale_rows 1) the widest split only.
    return [Config(dtype=dt, head_dim=d, block_size=bs, group=g, heads_per_warp=hw, scale_rows=r) for dt in dts
            for d in ds for bs in matrix.kernel_block_sizes(d, block_sizes) for g in GROUPS
            for hw in sorted({1, widest_heads(g, d)})
            for r in ((0, 1) if hw == widest_heads(g, d) else (0,))]


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    g, d = config.group, config.head_dim
    splits = tuple(h for h in range(1, widest_heads(g, d) + 1) if g % h == 0)
    return verdict(refusal(config, arch, dtype=DTYPES, head_dim=matrix.HEAD_DIMS, block_size=matrix.BLOCK_SIZES, group=GROUPS,
                           threads=(32 * ROWS_PER_CTA,), heads_per_warp=splits, scale_rows=(0, 1),
                           notes={"head_dim": "32 lanes x a whole number of elements", "threads": "one warp per row",
                                  "heads_per_warp": f"divisors of G with at most {LANE_ELEMENTS} elements per lane "
                                                    f"(hw D / 32)"}))


def params(config: Config) -> tuple:
    g, d = config.group, config.head_dim
    return (
        TensorParam("block_indices", "i32", ("B", "Hp", "S", "K"), ("i64", "i64", "i64", 1), align=4),
        TensorParam("o_part", config.dtype, ("E", g, d), (g * d, d, 1), align=16),
        TensorParam("lse_part", "f32", ("E", g), (g, 1), align=4),
        TensorParam("out", config.dtype, ("B", "S", "H", d), ("i64", "i64", "i64", 1), align=16),
        TensorParam("lse", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        *((TensorParam("sinks", "f32", ("H",), (1,), align=4),) if config.scale_rows else ()),
        ScalarParam("query_offset", "i32"),  # row r is query query_offset + r (the forward runs in query chunks)
    )


def build_set(config: Config, arch: str) -> str:
    """The widest heads per warp is what runs; one head per warp is kept for A/B runs."""
    return DEFAULT if config.heads_per_warp == widest_heads(config.group, config.head_dim) else OPT_IN


def build_spec(config: Config, arch: str) -> BuildSpec:
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"ceil_div(B * Hp * S * {config.group // config.heads_per_warp}, {ROWS_PER_CTA})",
                             "1", "1"),
                       compile_fn="kernels_src.sparse_combine.build:compile", smem_bytes=0)
