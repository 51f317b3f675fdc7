"""MSA proxy backward, KV-outer (msa-semantics.md, "Proxy KL loss": d kl / d s_p = (pi - tau) * upstream).

Work items of tiles of tile_m = 64 distinct queries (the plan's tile_queries is 64 whatever G); each tile visits
the G main heads one after another. Per tile: P_h = exp(s_h - lse_h) recomputed, tau = mean over the G heads, pi =
exp(s_p - lse_p), dS_p = (pi - tau) * kl_grad[b, p, i]; then dq_proxy += scale * dS_p K_p (atomics) and
dk_proxy += scale * dS_p^T Q_p (registers across the item's tiles, then atomics).
Configs: kernels_src.sparse_bwd's (64 keys per CTA). This module does not import cutlass.
"""

from __future__ import annotations

from flash_msa_rt.manifest import ScalarParam, TensorParam
from kernels_src import sparse_bwd
from kernels_src.spec import BuildSpec, family_spec, smem_refusal, verdict

OP = "sparse_bwd_proxy"

Config = sparse_bwd.MmaConfig  # mma "sync" (mma.sync) or "wgmma" (kernel wgmma.py, sm90a only)
configs = sparse_bwd.configs
_ELEM_BYTES = {"bf16": 2, "f16": 2}


def smem_bytes(config) -> int:
    """sK, sK_p (keys x D); staged sQ, sQ_p (rows x D); sdS_p (rows x keys); fp32 dq_p staging rows; the row
    scalars (query; lse_g, lse_p, kl_grad). Mirrors SharedStorage."""
    e = _ELEM_BYTES[config.dtype]
    a = sparse_bwd._align
    keys = 2 * a(config.tile_n * config.head_dim * e, 1024)
    rows = 2 * a(config.stages * config.tile_m * config.head_dim * e, 1024)
    return (keys + rows + a(config.tile_m * config.tile_n * e, 1024) + sparse_bwd.dq_staging_bytes(config)
            + row_table_bytes(config, ints=1, floats=3))


def row_table_bytes(config, ints: int, floats: int) -> int:
    """The staged row-scalar tables (tiles.row_table): ints and floats 4-byte fields per (row, stage), each
    table 1024-aligned like the tiles around it."""
    a = sparse_bwd._align
    return a(config.tile_m * config.stages * ints * 4, 1024) + a(config.tile_m * config.stages * floats * 4, 1024)


def can_implement(config, arch: str) -> tuple[bool, str]:
    ok, reason = sparse_bwd.can_implement(config, arch)  # its smem check is the main kernel's
    return verdict(reason or smem_refusal(smem_bytes(config), arch)) if ok else (ok, reason)


def params(config) -> tuple:
    c = config
    bshd = ("i64", "i64", "i64", 1)
    d = c.head_dim
    return (
        TensorParam("q", c.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("k", c.dtype, ("B", "S", "Hk", d), bshd, align=16),
        TensorParam("q_proxy", c.dtype, ("B", "S", "Hp", d), bshd, align=16),
        TensorParam("k_proxy", c.dtype, ("B", "S", "Hpk", d), bshd, align=16),
        TensorParam("entry_query", "i32", ("E",), (1,), align=4),
        TensorParam("items", "i32", ("W", 4), (4, 1), align=16),
        TensorParam("lse", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        TensorParam("lse_proxy", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4),
        TensorParam("kl_grad", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4),
        TensorParam("dqp_acc", "f32", ("B", "S", "Hp", d), bshd, align=16),
        TensorParam("dkp_acc", "f32", ("B", "S", "Hpk", d), bshd, align=16),
        ScalarParam("scale", "f32"),
        ScalarParam("hp_per_hk", "i32"),
        ScalarParam("hp_per_hpk", "i32"),
    )


def build_spec(config, arch: str) -> BuildSpec:
    # one CTA per (item, key slice)
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"W * {config.block_size // config.tile_n}", "1", "1"),
                       compile_fn="kernels_src.sparse_bwd_proxy.kernel:compile", smem_bytes=smem_bytes(config))
