"""fp8 selection's quantisation (select_precision="fp8"): x (B, S, H, D) to float8 e4m3 with one power-of-two scale
per (b, block of `block_size` tokens, h), byte for byte flash_msa_rt.reference.fp8's:
  - block_size 1: one scale per row, q_proxy's (reference.fp8.quantize_rows);
  - block_size Bs: one scale per key block of Bs tokens (the last one may be partial), k_proxy's
    (reference.fp8.quantize_key_blocks), the select kernel's k_scale.

One pass reads x once and writes x8 once plus the scales (3 bytes per bf16 element + 4 per scale), where the torch
ops moved ~7 bytes per element at ~0.9 TB/s (7.4% of fp8 selection at (b) S = 128K). Rows (block_size 1): D / 8
lanes per row, 16 bytes per lane, a butterfly max, as bwd_delta; key blocks: one CTA per (b, block, h) holding the
block's Bs x D elements in registers, a CTA-wide max, then the same conversion (kernels_src/fp8_quant/NOTES.md).
This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import TensorParam, variant_name
from kernels_src import matrix
from kernels_src.spec import DEFAULT, OPT_IN, BuildSpec, family_spec, refusal, verdict

OP = "fp8_quant"

DTYPES = ("bf16", "f16")  # the proxy's dtypes (fp8 selection quantises both)
HEAD_DIMS = (64, 128)  # Dp
BLOCK_SIZES = (1, 64, 128)  # 1: per row (q_proxy); 64, 128: per key block (k_proxy), the selection's Bs
ELEMS_PER_LANE = 8  # 16 bytes of input, 8 of output per lane
ROWS_PER_LANE = 2  # row kernel: two 16-byte loads in flight per lane, as bwd_delta's two inputs (at the DRAM floor)


@dataclass(frozen=True)
class Config:
    dtype: str = "bf16"
    head_dim: int = 128  # Dp
    block_size: int = 1  # tokens per scale: 1 (rows) or the selection's Bs (key blocks)
    threads: int = 256

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)


def lanes_per_row(config: Config) -> int:
    return config.head_dim // ELEMS_PER_LANE


def rows_per_pass(config: Config) -> int:
    """Rows a CTA's threads cover with one 16-byte load each."""
    return config.threads // lanes_per_row(config)


def rows_per_cta(config: Config) -> int:
    """Row kernel: the rows one CTA quantises (ROWS_PER_LANE per lane group)."""
    return rows_per_pass(config) * ROWS_PER_LANE


def smem_bytes(config: Config) -> int:
    """Key-block kernel: one int32 per warp for the CTA-wide max (16-byte aligned); the row kernel uses none."""
    return 0 if config.block_size == 1 else -(-config.threads // 32 * 4 // 16) * 16


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """The rows variant and the key-block variants of the selection's block sizes (default Bs 128), Dp 64 and 128
    (small kernels: Dp 64 selection is on its way)."""
    dts = tuple(dtypes) if dtypes else DTYPES
    ds = matrix.proxy_head_dims(head_dims)
    bss = (1, *matrix.block_sizes(block_sizes))
    return [Config(dtype=dt, head_dim=d, block_size=bs) for dt in dts for d in ds for bs in bss]


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    reason = refusal(config, arch, dtype=DTYPES, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES, threads=(256,),
                     notes={"block_size": "1: per row; 64, 128: per key block, the selection's Bs",
                            "threads": "a key block's Bs x Dp elements are 16 bytes per thread per pass"})
    return verdict(reason)


def params(config: Config) -> tuple:
    """x as select_blocks_cuda receives it (unit-stride head dim, 16-byte multiple strides elsewhere), x8 and
    scale contiguous at run time; NB = ceil(S / block_size) (S itself for rows)."""
    d = config.head_dim
    bshd = ("i64", "i64", "i64", 1)
    return (
        TensorParam("x", config.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("x8", "e4m3", ("B", "S", "H", d), bshd, align=16),
        TensorParam("scale", "f32", ("B", "NB", "H"), ("i64", "i64", 1), align=4),
    )


def grid(config: Config) -> tuple[str, str, str]:
    if config.block_size == 1:
        return (f"ceil_div(B * S * H, {rows_per_cta(config)})", "1", "1")
    return ("NB * H", "B", "1")  # one CTA per (b, key block, h), h fastest: neighbours share the block's rows


def build_set(config: Config, arch: str) -> str:
    """fp8 selection runs on sm90a only (its select variants are wgmma's): the default there, opt-in elsewhere."""
    return DEFAULT if arch == "sm90a" else OPT_IN


def build_spec(config: Config, arch: str) -> BuildSpec:
    return family_spec(OP, config, arch, can_implement, params=params(config), grid=grid(config),
                       compile_fn="kernels_src.fp8_quant.build:compile", smem_bytes=smem_bytes(config))
