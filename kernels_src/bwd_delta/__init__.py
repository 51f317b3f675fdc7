"""The backward's delta: delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] in fp32 (dS = P (dP - delta)).

A pass of its own because dO only exists in the backward. D / 8 lanes per (b, i, h) row, 16 bytes of each input
per lane, a butterfly sum: the op reads dO and O once (2 * 2 * D bytes per row) and writes 4 bytes, where torch's
fp32 copies of both moved ~7x that ((b) S = 64K B = 2: 5.5 ms; the floor is 0.5 ms at 4 TB/s).
scale_rows = 1 (attention sinks, flash_msa_rt.ops.sinks): the same pass also writes dout_scaled = k * dO per row,
k = exp(lse0 - lse) (1 - p_sink; 0 where lse0 = -inf), in the input dtype from fp32 products: the upstream gradient
that a sink-free backward on lse0 turns into the sink-adjusted softmax's, and, called with dout = out = dout_scaled,
the forward's out0 scaled in place (each lane reads its 16 bytes before it writes them). delta stays <dO, O>.
This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import TensorParam, variant_name
from kernels_src.row_lanes import row_grid
from kernels_src import matrix
from kernels_src.spec import DEFAULT, BuildSpec, family_spec, refusal, verdict

OP = "bwd_delta"

DTYPES = ("bf16", "f16")
HEAD_DIMS = matrix.HEAD_DIMS


@dataclass(frozen=True)
class Config:
    dtype: str = "bf16"
    head_dim: int = 128
    threads: int = 256
    scale_rows: int = 0

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """block_sizes: accepted for the catalogue's common signature; delta does not depend on it."""
    dts = tuple(dtypes) if dtypes else DTYPES
    ds = matrix.head_dims(head_dims)
    return [Config(dtype=dt, head_dim=d, scale_rows=r) for dt in dts for d in ds for r in (0, 1)]


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    return verdict(refusal(config, arch, dtype=DTYPES, head_dim=HEAD_DIMS, threads=(256,), scale_rows=(0, 1)))


def params(config: Config) -> tuple:
    d = config.head_dim
    bshd = ("i64", "i64", "i64", 1)
    return (
        TensorParam("dout", config.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("out", config.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("delta", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
    ) + ((
        TensorParam("lse0", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        TensorParam("lse", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        TensorParam("dout_scaled", config.dtype, ("B", "S", "H", d), bshd, align=16),
    ) if config.scale_rows else ())


def build_set(config: Config, arch: str) -> str:
    """Every backward runs it; scale_rows = 1 every call with sinks."""
    return DEFAULT


def build_spec(config: Config, arch: str) -> BuildSpec:
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=row_grid(config),
                       compile_fn="kernels_src.bwd_delta.build:compile", smem_bytes=0)
