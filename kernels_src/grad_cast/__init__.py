"""The backward's gradient cast: grad[b, i, h, :] = acc[b, i, h, :] rounded to grad's dtype (round to nearest even).

The sparse backward sums every gradient in fp32 accumulators, then casts each into the gradient, whose rows are
often strided: a run of head chunks' accumulator holds some heads and its gradient is a head slice of (B, S, H, D),
and in the (B, H, S, D) layout every gradient is a transposed view. torch copies such views element by element
(no vector loads): ~2.3 TB/s at (b) S = 64K, where this kernel reads and writes 16-byte vectors.
D / 8 lanes per (b, i, h) row, 8 elements each (two 16-byte loads of fp32, one 16-byte store).
This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import TensorParam, variant_name
from kernels_src.row_lanes import row_grid
from kernels_src import matrix
from kernels_src.spec import DEFAULT, BuildSpec, family_spec, refusal, verdict

OP = "grad_cast"

DTYPES = ("bf16", "f16")
HEAD_DIMS = matrix.HEAD_DIMS  # main heads D and the proxy's Dp (64 is built by default: a proxy of Dp 64)


@dataclass(frozen=True)
class Config:
    dtype: str = "bf16"
    head_dim: int = 128
    threads: int = 256

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """block_sizes: accepted for the catalogue's common signature; the cast does not depend on it."""
    dts = tuple(dtypes) if dtypes else DTYPES
    ds = matrix.head_dims(head_dims)
    return [Config(dtype=dt, head_dim=d) for dt in dts for d in ds]


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    return verdict(refusal(config, arch, dtype=DTYPES, head_dim=HEAD_DIMS, threads=(256,)))


def params(config: Config) -> tuple:
    d = config.head_dim
    rows = ("i64", "i64", "i64", 1)  # any strides, unit-stride 16-byte aligned rows
    return (
        TensorParam("acc", "f32", ("B", "S", "H", d), rows, align=16),
        TensorParam("grad", config.dtype, ("B", "S", "H", d), rows, align=16),
    )


def build_set(config: Config, arch: str) -> str:
    """Every backward that runs in head chunks or writes a transposed layout runs it."""
    return DEFAULT


def build_spec(config: Config, arch: str) -> BuildSpec:
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=row_grid(config),
                       compile_fn="kernels_src.grad_cast.build:compile", smem_bytes=0)
