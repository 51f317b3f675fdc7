"""MSA proxy backward, KV-outer (msa-semantics.md, "Proxy KL loss": d kl / d s_p = (pi - tau) * upstream).

Work items of tiles of tile_m = 64 distinct queries (the plan's tile_queries is 64 whatever G); each tile visits
the G main heads one after another. Per tile: P_h = exp(s_h - lse_h) recomputed (s_h at scale), tau = mean over the
G heads, pi = exp(s_p - lse_p) (s_p at proxy_scale), dS_p = (pi - tau) * kl_grad[b, p, i]; then dq_proxy +=
proxy_scale * dS_p K_p (atomics) and dk_proxy += proxy_scale * dS_p^T Q_p (registers across the item's tiles, then
atomics).
Configs: kernels_src.sparse_bwd's (64 keys per CTA). This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam
from kernels_src import matrix, sparse_bwd
from kernels_src.spec import OPT_IN, BuildSpec, family_spec, mma_set, smem_refusal, verdict

OP = "sparse_bwd_proxy"

_ELEM_BYTES = {"bf16": 2, "f16": 2}
# "stepped": a tile visits its G main heads one step at a time (kernel.py, wgmma.py); "resident" (resident.py,
# wgmma on the whole block at G <= 4): a tile's G head tiles and proxy rows gathered at once; "tau" (tau.py, wgmma
# on the whole block): tau read from the main backward (sparse_bwd tau_out = 1) instead of recomputed, one variant
# per dtype (group 1: nothing in it depends on G)
HEADS = ("stepped", "resident", "tau")
RESIDENT_GROUPS = (1, 2, 4)
# The tau kernel's buffers of proxy rows, tau rows and row scalars: a tile's rows are gathered two tiles ahead
# (one ahead left the gathers' latency at the tile's first barrier: kernels_src/sparse_bwd/NOTES.md).
TAU_STAGES = 3


@dataclass(frozen=True)
class Config(sparse_bwd.MmaConfig):
    """The backward's tiles and MMA (mma "sync" or "wgmma", sm90a only) plus how a tile visits its heads."""

    heads: str = "stepped"
    deterministic: int = 0  # 1: heads "tau" storing partial rows instead of adding (sparse_bwd.MainConfig)
    # 1 (heads "tau"): also each entry's share of its row's KL value (tau.py), for the deferred KL mode's
    # backward, which then needs no KL pass
    kl_value: int = 0


def resident_ok(config) -> bool:
    return config.mma == "wgmma" and config.tile_n == config.block_size and config.group in RESIDENT_GROUPS


def tau_ok(config) -> bool:
    return config.mma == "wgmma" and config.tile_n == config.block_size and config.group == 1


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """The backward's variants with the heads stepped, the whole-block wgmma ones at G <= 4 again with them
    resident (these recompute tau from the main heads: D wide), and at G = 1 with tau read, at each proxy head dim
    Dp the heads chosen serve, on their kernels' key blocks (the tau kernel reads the proxy alone)."""
    base = [Config(**dataclasses.asdict(c)) for c in sparse_bwd.mma_configs(head_dims, block_sizes, dtypes)]
    proxy = [Config(**dataclasses.asdict(c)) for c in sparse_bwd.mma_configs(
        matrix.proxy_head_dims(head_dims), matrix.any_kernel_block_sizes(head_dims, block_sizes), dtypes)]
    tau = [dataclasses.replace(c, heads="tau", deterministic=d, stages=TAU_STAGES, kl_value=kl) for d in (0, 1)
           for kl in (0, 1) for c in proxy if tau_ok(c)]
    return list(dict.fromkeys(base + [dataclasses.replace(c, heads="resident") for c in base if resident_ok(c)]
                              + tau))


def smem_bytes(config) -> int:
    """sK, sK_p (keys x D); staged sQ, sQ_p (rows x D), or with resident heads the G head tiles once and the
    proxy rows per stage; sdS_p (rows x keys); fp32 dq_p staging rows; the row scalars (query; lse_g (G of them
    with resident heads), lse_p, kl_grad). Mirrors SharedStorage."""
    e = _ELEM_BYTES[config.dtype]
    a = sparse_bwd._align
    keys = 2 * a(config.tile_n * config.head_dim * e, 1024)
    tile = config.tile_m * config.head_dim * e
    heads = getattr(config, "heads", "stepped")
    if heads == "tau":  # sK_p only; proxy rows (Dp wide) and tau rows (Bs wide) per stage; ints [query], floats
        tau = config.tile_m * config.tile_n * e  # [lse_p, kl_grad]
        return (keys // 2 + a(config.stages * tile, 1024) + a(config.stages * tau, 1024) + a(tau, 1024)
                + sparse_bwd.dq_staging_bytes(config) + row_table_bytes(config, ints=1, floats=2))
    if heads == "resident":
        rows = a(config.group * tile, 1024) + a(config.stages * tile, 1024)
        floats = config.group + 2
    else:
        rows = 2 * a(config.stages * tile, 1024)
        floats = 3
    return (keys + rows + a(config.tile_m * config.tile_n * e, 1024) + sparse_bwd.dq_staging_bytes(config)
            + row_table_bytes(config, ints=1, floats=floats))


def row_table_bytes(config, ints: int, floats: int) -> int:
    """The staged row-scalar tables (tiles.row_table): ints and floats 4-byte fields per (row, stage), each
    table 1024-aligned like the tiles around it."""
    a = sparse_bwd._align
    return a(config.tile_m * config.stages * ints * 4, 1024) + a(config.tile_m * config.stages * floats * 4, 1024)


def can_implement(config, arch: str) -> tuple[bool, str]:
    # The backward's tile checks (its smem check is the main kernel's, at its own two stages).
    ok, reason = sparse_bwd.can_implement(dataclasses.replace(config, stages=min(config.stages, 2)), arch)
    if not ok:
        return ok, reason
    heads = getattr(config, "heads", "stepped")
    det = getattr(config, "deterministic", 0)
    kl_value = getattr(config, "kl_value", 0)
    if kl_value not in (0, 1) or (kl_value and heads != "tau"):
        reason = f"kl_value {kl_value!r} with heads {heads!r}: supported kl_value 0, or 1 with heads 'tau'"
    elif det not in (0, 1) or (det and heads != "tau"):
        reason = f"deterministic {det!r} with heads {heads!r}: supported deterministic 0, or 1 with heads 'tau'"
    elif heads not in HEADS:
        reason = f"heads {heads!r} not supported; supported: {', '.join(map(repr, HEADS))}"
    elif heads == "resident" and not (resident_ok(config) and config.stages == 2):
        reason = (f"heads 'resident' needs wgmma on the whole block (tile_n = block_size), G in {RESIDENT_GROUPS} "
                  f"and stages 2; got mma {config.mma!r}, tile_n {config.tile_n}, G {config.group}, "
                  f"stages {config.stages}")
    elif heads == "tau" and not (tau_ok(config) and config.stages == TAU_STAGES):
        reason = (f"heads 'tau' needs wgmma on the whole block (tile_n = block_size), group 1 (one variant serves "
                  f"every G) and stages {TAU_STAGES}; got mma {config.mma!r}, tile_n {config.tile_n}, "
                  f"G {config.group}, stages {config.stages}")
    return verdict(reason or smem_refusal(smem_bytes(config), arch))


def params(config) -> tuple:
    """q, q_proxy, lse, lse_proxy, kl_grad, dqp: S query rows; k, k_proxy, dkp: Sk >= S keys (query row i at key
    position Sk - S + i)."""
    c = config
    bshd = ("i64", "i64", "i64", 1)
    d = c.head_dim
    every = (
        TensorParam("q", c.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("k", c.dtype, ("B", "Sk", "Hk", d), bshd, align=16),
        TensorParam("q_proxy", c.dtype, ("B", "S", "Hp", d), bshd, align=16),
        TensorParam("k_proxy", c.dtype, ("B", "Sk", "Hpk", d), bshd, align=16),
        TensorParam("entry_query", "i32", ("E",), (1,), align=4),
        TensorParam("items", "i32", ("W", 4), (4, 1), align=16),
        TensorParam("lse", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        TensorParam("lse_proxy", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4),
        TensorParam("kl_grad", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4),
        *sparse_bwd.gradient_params(dataclasses.replace(c, group=1), ("dqp", "Hp"), ("dkp", "Hpk")),
        ScalarParam("scale", "f32"),  # the main scores' (the recomputed tau)
        ScalarParam("proxy_scale", "f32"),  # the proxy scores' (pi; dq_p and dk_p are scaled by it)
        ScalarParam("hp_per_hk", "i32"),
        ScalarParam("hp_per_hpk", "i32"),
    )
    if getattr(c, "heads", "stepped") != "tau":
        return every
    # The tau kernel needs no main rows, keys, lse or main scale (its one scale is proxy_scale); tau (E,
    # block_size) follows the proxy keys.
    kept = [p for p in every if p.name not in ("q", "k", "lse", "scale", "hp_per_hk")]
    tau = sparse_bwd.tau_params(sparse_bwd.MainConfig(**dict(_mma_fields(c), tau_out=1)))
    # kl_value 1: each entry's row slot (the plan's entry_dest) and the fp32 slots its KL share is added into
    kl = (TensorParam("kl_dest", "i32", ("E",), (1,), align=4),
          TensorParam("kl_slots", "f32", ("R",), (1,), align=4)) if getattr(c, "kl_value", 0) else ()
    return (*kept[:2], *tau, *kept[2:-2], *sparse_bwd.turn_params(c), *kl, *kept[-2:])  # turns after dkp


def _mma_fields(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(sparse_bwd.MmaConfig)}


def build_set(config, arch: str) -> str:
    """On wgmma a tile gets tau from the main backward ("tau", and its deterministic variant) or, without it,
    recomputes it with resident heads at G <= 4 and stepped heads above (flash_msa_rt's sparse_bwd tuning); the
    stepped wgmma kernel at G <= 4 is an A/B alternate, except at D 256, where resident heads do not fit."""
    c = config
    if c.mma == "wgmma" and c.heads == "stepped" and resident_ok(c) and not matrix.wide(c.head_dim):
        return OPT_IN
    return mma_set(c.mma, arch)


def build_spec(config, arch: str) -> BuildSpec:
    # one CTA per (item, key slice)
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"W * {config.block_size // config.tile_n}", "1", "1"),
                       compile_fn="kernels_src.sparse_bwd_proxy.build:compile", smem_bytes=smem_bytes(config))
