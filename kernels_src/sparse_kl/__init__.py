"""MSA KL pass: each (query, slot)'s shares of its row's KL and proxy lse (msa-semantics.md, "Proxy KL loss").

Runs after the forward pass and its combine, over work items of 64 distinct queries per tile (the proxy backward's
tiles: kernels_src.sparse_bwd_proxy), with the final lse of every main head. For the entry d of (b, p, i, slot),
key slice s of the slot's block and key warp w it writes (A, T, L) to kl_part[d, s, w] (kernel.py says what they
are); flash_msa_rt.ops.sparse_plan.combine_kl_lse turns them into lse_proxy and kl_rows. Configs: sparse_bwd's.
This module does not import cutlass.
"""

from __future__ import annotations

from flash_msa_rt.manifest import ScalarParam, TensorParam
from kernels_src import sparse_bwd
from kernels_src.spec import BuildSpec, family_spec, smem_refusal, verdict

OP = "sparse_kl"

Config = sparse_bwd.MmaConfig
configs = sparse_bwd.configs
_ELEM_BYTES = {"bf16": 2, "f16": 2}


# wgmma on the whole block at these G gathers a tile's G main heads and the proxy at once (kernels_src.sparse_kl.
# wgmma); every other config gathers one head per step.
RESIDENT_GROUPS = (1, 2, 4)


def resident_heads(config) -> bool:
    return getattr(config, "mma", "sync") == "wgmma" and config.tile_n == config.block_size and \
        config.group in RESIDENT_GROUPS


def smem_bytes(config) -> int:
    """sK, sK_p (keys x D); staged sQ, sQ_p (queries x D), or with resident heads the G + 1 head tiles per
    stage. Mirrors SharedStorage."""
    e = _ELEM_BYTES[config.dtype]
    a = sparse_bwd._align
    rows = config.stages * config.tile_m * config.head_dim * e
    if resident_heads(config):
        return 2 * a(config.tile_n * config.head_dim * e, 1024) + a((config.group + 1) * rows, 1024)
    return 2 * a(config.tile_n * config.head_dim * e, 1024) + 2 * a(rows, 1024)


def can_implement(config, arch: str) -> tuple[bool, str]:
    ok, reason = sparse_bwd.can_implement(config, arch)  # its smem check is the main backward's
    return verdict(reason or smem_refusal(smem_bytes(config), arch)) if ok else (ok, reason)


def params(config) -> tuple:
    c = config
    bshd = ("i64", "i64", "i64", 1)
    d = c.head_dim
    slices = c.block_size // c.tile_n
    return (
        TensorParam("q", c.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("k", c.dtype, ("B", "S", "Hk", d), bshd, align=16),
        TensorParam("q_proxy", c.dtype, ("B", "S", "Hp", d), bshd, align=16),
        TensorParam("k_proxy", c.dtype, ("B", "S", "Hpk", d), bshd, align=16),
        TensorParam("entry_query", "i32", ("E",), (1,), align=4),
        TensorParam("entry_dest", "i32", ("E",), (1,), align=4),
        TensorParam("items", "i32", ("W", 4), (4, 1), align=16),
        TensorParam("lse", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        # [key slice][key warp][A, T, L]: see kernels_src.sparse_kl.kernel.
        TensorParam("kl_part", "f32", ("E", slices * 6), (slices * 6, 1), align=4),
        ScalarParam("scale", "f32"),
        ScalarParam("hp_per_hk", "i32"),
        ScalarParam("hp_per_hpk", "i32"),
    )


def build_spec(config, arch: str) -> BuildSpec:
    # one CTA per (item, key slice)
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"W * {config.block_size // config.tile_n}", "1", "1"),
                       compile_fn="kernels_src.sparse_kl.kernel:compile", smem_bytes=smem_bytes(config))
