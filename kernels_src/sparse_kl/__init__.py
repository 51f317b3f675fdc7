"""MSA KL pass: each (query, slot)'s shares of its row's KL and proxy lse (msa-semantics.md, "Proxy KL loss").

Runs after the forward pass and its combine, over work items of 64 distinct queries per tile (the proxy backward's
tiles: kernels_src.sparse_bwd_proxy), with the final lse of every main head. For the entry d of (b, p, i, slot)
and each key group of the slot's block it writes (A, T, L) to kl_part[d, group] (kernel.py says what they are):
the groups are the key slices x key warps (or warpgroups) in lockstep, one whole block in ping-pong (key_groups);
kernels_src.sparse_combine_kl (its torch statement: flash_msa_rt.ops.partials.combine_kl_lse) turns them into
lse_proxy and kl_rows. Configs: sparse_bwd's tiles plus the schedule. This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam
from kernels_src import matrix, sparse_bwd
from kernels_src.spec import OPT_IN, BuildSpec, family_spec, mma_set, smem_refusal, verdict

OP = "sparse_kl"

_ELEM_BYTES = {"bf16": 2, "f16": 2}
# "lockstep": both warpgroups on one tile, each on half the block's keys (wgmma.py), or the mma.sync kernel;
# "pingpong" (pingpong.py, resident heads only): each warpgroup runs its own tiles over all the block's keys
SCHEDULES = ("lockstep", "pingpong")


@dataclass(frozen=True)
class Config(sparse_bwd.MmaConfig):
    """The backward's tiles and MMA plus how the two warpgroups share the work (SCHEDULES)."""

    schedule: str = "lockstep"
    # 1: each entry's (A, T, L); 0: L alone, A = T = 0 (lse.py: the proxy lse without the KL value, for the
    # deferred and "none" KL modes; group 1, ping-pong, serves every G)
    kl_value: int = 1


STREAM_STAGES = 4  # ring slots per warpgroup of the streamed ping-pong kernel (G >= 8)


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """The proxy backward's variants in lockstep, and the whole-block wgmma ones again in ping-pong: with resident
    heads (G <= 4) single-buffered (two warpgroups x (G + 1) tiles of 16 KB beside the 64 KB key block leave no
    room for a second stage), at G >= 8 with the heads streamed through STREAM_STAGES slots per warpgroup. The
    proxy lse alone (kl_value 0, group 1, ping-pong) at each proxy head dim Dp the heads chosen serve, on their
    kernels' key blocks (it reads the proxy alone)."""
    def pingpong(cfgs):
        return [dataclasses.replace(c, schedule="pingpong", stages=1 if resident_heads(c) else STREAM_STAGES)
                for c in cfgs if c.mma == "wgmma" and c.tile_n == c.block_size]

    base = [Config(**dataclasses.asdict(c)) for c in sparse_bwd.mma_configs(head_dims, block_sizes, dtypes)]
    proxy = [Config(**dataclasses.asdict(c)) for c in sparse_bwd.mma_configs(
        matrix.proxy_head_dims(head_dims), matrix.any_kernel_block_sizes(head_dims, block_sizes), dtypes)]
    lse_only = [dataclasses.replace(c, kl_value=0) for c in pingpong(proxy) if c.group == 1]
    return list(dict.fromkeys(base + pingpong(base) + lse_only))


# wgmma on the whole block at these G gathers a tile's G main heads and the proxy at once (kernels_src.sparse_kl.
# wgmma); every other config gathers one head per step.
RESIDENT_GROUPS = (1, 2, 4)


def resident_heads(config) -> bool:
    return getattr(config, "mma", "sync") == "wgmma" and config.tile_n == config.block_size and \
        config.group in RESIDENT_GROUPS


def key_groups(config) -> int:
    """(A, T, L) triples per entry: one per warpgroup's keys, 64-key slices x their two halves, or in ping-pong
    one (a warpgroup holds all the block's keys of its rows)."""
    if getattr(config, "schedule", "lockstep") == "pingpong":
        return 1
    return 2 * (config.block_size // config.tile_n)


def smem_bytes(config) -> int:
    """sK, sK_p (keys x D); staged sQ, sQ_p (queries x D), or with resident heads the G + 1 head tiles per
    stage (per warpgroup in ping-pong, with its ring of staged entries). Mirrors SharedStorage."""
    e = _ELEM_BYTES[config.dtype]
    a = sparse_bwd._align
    rows = config.stages * config.tile_m * config.head_dim * e
    if not getattr(config, "kl_value", 1):  # sK_p, one proxy tile per warpgroup, their entry rings (lse.py)
        return a(config.tile_n * config.head_dim * e, 1024) + a(2 * rows, 1024) + a(2 * 2 * config.tile_m * 4, 1024)
    kv = 2 * a(config.tile_n * config.head_dim * e, 1024)
    if getattr(config, "schedule", "lockstep") == "pingpong":
        if resident_heads(config):  # + each warpgroup's two slots of staged entries
            return kv + a(2 * (config.group + 1) * rows, 1024) + a(2 * 2 * config.tile_m * 4, 1024)
        return kv + a(2 * rows, 1024) + a(2 * config.stages * config.tile_m * 4, 1024)  # ring + lse table
    if resident_heads(config):
        return kv + a((config.group + 1) * rows, 1024)
    return kv + 2 * a(rows, 1024)


def can_implement(config, arch: str) -> tuple[bool, str]:
    schedule = getattr(config, "schedule", "lockstep")
    # The backward's tile checks (its smem check is the main backward's); a ping-pong ring's depth is this
    # kernel's own, checked below.
    tiles = dataclasses.replace(config, stages=min(config.stages, 2)) if schedule == "pingpong" else config
    ok, reason = sparse_bwd.can_implement(tiles, arch)
    if not ok:
        return ok, reason
    kl_value = getattr(config, "kl_value", 1)
    if kl_value not in (0, 1):
        reason = f"kl_value {kl_value!r} not supported; supported: 0 (the proxy lse alone), 1 (A, T, L)"
    elif not kl_value and (schedule, config.group, config.stages) != ("pingpong", 1, 1):
        reason = (f"kl_value 0 (the proxy lse alone) is built for schedule 'pingpong', group 1, stages 1, not "
                  f"{schedule!r}, group {config.group}, stages {config.stages}")
    elif schedule not in SCHEDULES:
        reason = f"schedule {schedule!r} not supported; supported: {', '.join(map(repr, SCHEDULES))}"
    elif schedule == "pingpong" and not (config.mma == "wgmma" and config.tile_n == config.block_size and
                                         (config.stages == 1 if resident_heads(config) else config.stages >= 2)):
        reason = (f"schedule 'pingpong' needs wgmma on the whole block (tile_n = block_size), stages 1 at G in "
                  f"{RESIDENT_GROUPS} (resident heads) and >= 2 otherwise (streamed); got mma {config.mma!r}, "
                  f"tile_n {config.tile_n}, G {config.group}, stages {config.stages}")
    return verdict(reason or smem_refusal(smem_bytes(config), arch))


def params(config) -> tuple:
    """q, q_proxy, lse: S query rows; k, k_proxy: Sk >= S keys (query row i at key position Sk - S + i)."""
    c = config
    bshd = ("i64", "i64", "i64", 1)
    d = c.head_dim
    if not getattr(c, "kl_value", 1):  # lse.py: the proxy alone
        return (
            TensorParam("q_proxy", c.dtype, ("B", "S", "Hp", d), bshd, align=16),
            TensorParam("k_proxy", c.dtype, ("B", "Sk", "Hpk", d), bshd, align=16),
            TensorParam("entry_query", "i32", ("E",), (1,), align=4),
            TensorParam("entry_dest", "i32", ("E",), (1,), align=4),
            TensorParam("items", "i32", ("W", 4), (4, 1), align=16),
            TensorParam("kl_part", "f32", ("E", 3), (3, 1), align=4),
            ScalarParam("proxy_scale", "f32"),  # the proxy scores' (the only ones read here)
            ScalarParam("hp_per_hpk", "i32"),
        )
    return (
        TensorParam("q", c.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("k", c.dtype, ("B", "Sk", "Hk", d), bshd, align=16),
        TensorParam("q_proxy", c.dtype, ("B", "S", "Hp", d), bshd, align=16),
        TensorParam("k_proxy", c.dtype, ("B", "Sk", "Hpk", d), bshd, align=16),
        TensorParam("entry_query", "i32", ("E",), (1,), align=4),
        TensorParam("entry_dest", "i32", ("E",), (1,), align=4),
        TensorParam("items", "i32", ("W", 4), (4, 1), align=16),
        TensorParam("lse", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        # [key group][A, T, L]: see kernels_src.sparse_kl.kernel.
        TensorParam("kl_part", "f32", ("E", 3 * key_groups(c)), (3 * key_groups(c), 1), align=4),
        ScalarParam("scale", "f32"),  # the main scores' (tau)
        ScalarParam("proxy_scale", "f32"),  # the proxy scores' (pi, lse_p, the KL's A)
        ScalarParam("hp_per_hk", "i32"),
        ScalarParam("hp_per_hpk", "i32"),
    )


def build_set(config, arch: str) -> str:
    """wgmma runs the KL pass in ping-pong (the configs() stages: resident heads at G <= 4, streamed above):
    flash_msa_rt's sparse_fwd tuning; the lockstep wgmma kernel is its A/B alternate, except at D 256, where it is
    the KL pass (ping-pong's head tiles do not fit)."""
    if config.mma == "wgmma" and (config.schedule != "pingpong") != matrix.wide(config.head_dim):
        return OPT_IN  # at D 256 ping-pong fits at G = 1 only, and the runtime runs lockstep
    return mma_set(config.mma, arch)


def build_spec(config, arch: str) -> BuildSpec:
    # one CTA per (item, key slice)
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"W * {config.block_size // config.tile_n}", "1", "1"),
                       compile_fn="kernels_src.sparse_kl.build:compile", smem_bytes=smem_bytes(config))
