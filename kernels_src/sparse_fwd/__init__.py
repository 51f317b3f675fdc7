"""MSA main sparse forward, KV-outer (msa-semantics.md, "Main sparse attention" and "Proxy KL loss").

Work is cut by flash_msa_rt.ops.sparse_plan: an item is one key block j of one (b, p) plus up to a few tiles of the
queries that selected it. A tile has 128 rows, row r = (query r // G, head p*G + r % G): the G heads of a proxy
group share the query's blocks, so they fill the matrix units together (architecture.md, "why KV-outer").

Per (entry, head) the kernel writes the one-block partial output O_slot / l_slot and lse_slot;
kernels_src.sparse_combine merges each row's K slots (a logsumexp merge), and kernels_src.sparse_kl then takes
the proxy lse and the true KL.

This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, variant_name
from kernels_src import matrix
from kernels_src.spec import OPT_IN, BuildSpec, family_spec, mma_set, refusal, smem_refusal, verdict

OP = "sparse_fwd"

DTYPES = ("bf16", "f16")
HEAD_DIMS = matrix.HEAD_DIMS
GROUPS = (1, 2, 4, 8, 16)  # G = H / Hp: a power of two that divides the 16 rows of one warp's MMA slab
MMAS = ("sync", "wgmma")
SCHEDULES = {"sync": ("lockstep",), "wgmma": ("lockstep", "pingpong")}  # built per MMA
# q tile buffers built per schedule; ping-pong with one buffer runs two CTAs per SM (pingpong.py)
STAGES = {"lockstep": (2,), "pingpong": (1, 2)}

_ELEM_BYTES = {"bf16": 2, "f16": 2}


@dataclass(frozen=True)
class Config:
    """Every codegen choice of one variant, in naming order."""

    dtype: str = "bf16"
    head_dim: int = 128  # D
    block_size: int = 128  # Bs: the key block, one per item
    group: int = 4  # G: heads per proxy head; a tile holds 128 // G queries x G heads
    tile_m: int = 128  # rows per tile
    threads: int = 256  # 8 warps x 16 rows
    stages: int = 2  # gathered q tile buffers: the next tile's gather overlaps this tile's math
    mma: str = "sync"  # "sync": mma.sync (sm90a, sm100a); "wgmma": warpgroup MMA (sm90a only, kernel wgmma.py)
    # "lockstep": both warpgroups through every phase of a tile together; "pingpong" (wgmma only, pingpong.py):
    # each warpgroup gathers and syncs its own rows and their QK products take turns
    schedule: str = "lockstep"

    def variant_name(self, arch: str, op: str = OP) -> str:
        return variant_name(op, dataclasses.asdict(self), arch)

    def smem_bytes(self) -> int:
        """Staged sQ, sK, sV: 128-row tiles, each 1024-aligned (128B-swizzle atoms). Mirrors SharedStorage."""
        e = _ELEM_BYTES[self.dtype]
        kv = _align(self.block_size * self.head_dim * e, 1024)
        return _align(self.stages * self.tile_m * self.head_dim * e, 1024) + 2 * kv


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """The default set: bf16 and f16, D = 128, Bs 128, every G."""
    dts = tuple(dtypes) if dtypes else DTYPES
    ds = matrix.head_dims(head_dims)
    return [Config(dtype=dt, head_dim=d, block_size=bs, group=g, mma=m, schedule=sc, stages=st)
            for dt in dts for d in ds for bs in matrix.kernel_block_sizes(d, block_sizes) for g in GROUPS
            for m in MMAS for sc in SCHEDULES[m] for st in STAGES[sc] if st == 2 or matrix.forward_stages(d, g) == 1]


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    c = config
    reason = refusal(c, arch, dtype=DTYPES, head_dim=HEAD_DIMS, block_size=matrix.BLOCK_SIZES, group=GROUPS, tile_m=(128,),
                     threads=(256,), mma=MMAS, stages=(1, 2),
                     notes={"block_size": "one key block = one MMA tile", "group": "G = H / Hp",
                            "tile_m": "8 warps x 16 rows", "threads": "8 warps x 16 rows"})
    if reason is None and c.mma == "wgmma" and arch != "sm90a":
        reason = f"mma 'wgmma' is Hopper's warpgroup MMA: sm90a only, not {arch}"
    if reason is None and c.stages not in STAGES.get(c.schedule, ()):
        reason = (f"stages {c.stages} not supported with schedule {c.schedule!r}; supported: "
                  f"{', '.join(map(str, STAGES.get(c.schedule, ())))}")
    if reason is None and c.stages == 1 and c.group == 1:
        reason = "stages 1 at group 1 spills at the 128 registers of two CTAs per SM (pingpong.py); stages 2 builds"
    if reason is None and c.stages != matrix.forward_stages(c.head_dim, c.group) and matrix.wide(c.head_dim):
        reason = ("stages 1 at D 256: one q buffer's kernel needs 158 registers against the 128 of two CTAs per SM "
                  "(ptxas C7602); stages 2 builds")
    if reason is None and c.schedule not in SCHEDULES[c.mma]:
        reason = (f"schedule {c.schedule!r} not supported with mma {c.mma!r}; supported: "
                  f"{', '.join(map(repr, SCHEDULES[c.mma]))} (ping-pong takes turns between warpgroup MMAs)")
    return verdict(reason or smem_refusal(c.smem_bytes(), arch))


def params(config: Config) -> tuple:
    """The kernel param ABI, in PTX .param order: q (B, S, H, D), k, v (B, Sk, Hk, D) with a unit-stride head dim
    (Sk >= S: query row i sits at key position Sk - S + i, bottom-right causal alignment), the plan
    (flash_msa_rt.ops.sparse_plan: entry_query / entry_dest (E,), items (W, 4)), the partial buffers, and the
    scalars (kv head = p // (Hp / Hk); Hp >= Hk is required)."""
    c = config
    bshd = ("i64", "i64", "i64", 1)
    g, d = c.group, c.head_dim
    return (
        TensorParam("q", c.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("k", c.dtype, ("B", "Sk", "Hk", d), bshd, align=16),
        TensorParam("v", c.dtype, ("B", "Sk", "Hk", d), bshd, align=16),
        TensorParam("entry_query", "i32", ("E",), (1,), align=4),
        TensorParam("entry_dest", "i32", ("E",), (1,), align=4),
        TensorParam("items", "i32", ("W", 4), (4, 1), align=16),
        TensorParam("o_part", c.dtype, ("E", g, d), (g * d, d, 1), align=16),
        TensorParam("lse_part", "f32", ("E", g), (g, 1), align=4),
        ScalarParam("scale", "f32"),
        ScalarParam("hp", "i32"),
        ScalarParam("hp_per_hk", "i32"),
    )


def build_set(config: Config, arch: str) -> str:
    """wgmma runs in ping-pong, with one q buffer at G >= 2 (two at G = 1, where one spills, and at D 256):
    flash_msa_rt's sparse_fwd tuning. The lockstep wgmma kernel and ping-pong with two buffers at G >= 2 are its
    A/B alternates."""
    c = config
    if c.mma == "wgmma" and (c.schedule != "pingpong" or c.stages != matrix.forward_stages(c.head_dim, c.group)):
        return OPT_IN
    return mma_set(c.mma, arch)


def build_spec(config: Config, arch: str) -> BuildSpec:
    # one CTA per work item; items past the real count exit at once
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=("W", "1", "1"),
                       compile_fn="kernels_src.sparse_fwd.build:compile", smem_bytes=config.smem_bytes())
