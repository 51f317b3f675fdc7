"""MSA main sparse backward, KV-outer (msa-semantics.md, "Main sparse attention"; the FlashAttention-2 backward
recurrence on gathered rows).

Same work items as the forward (flash_msa_rt.ops.sparse_plan) with 64-row tiles, head-major: row r = (query
r % (64 // G), head p*G + r // (64 // G)). Per item (key block j of (b, p)), with the saved lse and delta = rowsum(dO * O):
  P = exp(s - lse) (causal), dP = dO V^T, dS = P (dP - delta);
  dV_j += P^T dO and dK_j += scale dS^T Q stay in registers across the item's tiles, then go to fp32 accumulators
  with atomics (items of one block, and proxy heads sharing a KV head, meet there);
  dQ += scale dS K_j goes to an fp32 accumulator with bulk reductions (a query's K slots meet there).
The proxy's gradients come from kernels_src.sparse_bwd_proxy. This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, variant_name
from kernels_src import matrix
from kernels_src.spec import OPT_IN, BuildSpec, family_spec, mma_set, refusal, smem_refusal, verdict

OP = "sparse_bwd"

DTYPES = ("bf16", "f16")
GROUPS = (1, 2, 4, 8, 16)
_ELEM_BYTES = {"bf16": 2, "f16": 2}
# fp32 dq staging rows are padded by 8 floats: a warp's store of the accumulator (8 rows x 4 column pairs) then
# spreads over all 32 banks (unpadded 512-byte rows put the 8 rows on the same banks).
DQ_ROW_PAD = 8
# The item's plan entries (its queries) are staged in shared memory once per item, so that the gathers, the row
# scalars and the dq reductions of every tile read them there instead of starting each tile with a dependent
# global load. 2048 entries cover the runtime's items (32 tiles of 64 // G queries) at every G; entries past the
# table are read from global memory.
ENTRY_TABLE = 2048
# threads = 384: the warp-specialised variant (producer.py), 256 consumers and a producer warpgroup gathering the
# tiles; built for the atomic tau kernels at G <= 4 (the consumers get 232 registers; at G >= 8 they use ~250).
PRODUCER_THREADS = 384
PRODUCER_GROUPS = (1, 2, 4)


@dataclass(frozen=True)
class Config:
    dtype: str = "bf16"
    head_dim: int = 128
    block_size: int = 128
    group: int = 4
    tile_m: int = 64  # rows per tile: S, dP and dQ fragments of 8 warps (4 x 2) stay small
    tile_n: int = 64  # keys per CTA: a key block is split over block_size // tile_n CTAs (register budget)
    threads: int = 256
    stages: int = 2  # gathered q / dO buffers

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)

    def smem_bytes(self) -> int:
        """sK, sV; staged sQ, sdO; sP^T and sdS^T (keys x rows); the fp32 dQ staging rows (padded); the item's
        entries; the staged row scalars (lse, delta). Mirrors SharedStorage (1024-aligned)."""
        e = _ELEM_BYTES[self.dtype]
        kv = 2 * _align(self.tile_n * self.head_dim * e, 1024)
        rows = 2 * _align(self.stages * self.tile_m * self.head_dim * e, 1024)
        p_ds = 2 * _align(self.tile_n * self.tile_m * e, 1024)
        barriers = _align(2 * self.stages * 8, 1024) if self.threads == PRODUCER_THREADS else 0  # full, empty
        return (barriers + kv + rows + p_ds + dq_query_staging_bytes(self) + _align(ENTRY_TABLE * 4, 1024)
                + _align(self.tile_m * self.stages * 2 * 4, 1024))


def dq_staging_bytes(config) -> int:
    """fp32 rows of head_dim + DQ_ROW_PAD floats, one per tile row, for the bulk reductions."""
    return _align(config.tile_m * (config.head_dim + DQ_ROW_PAD) * 4, 1024)


def dq_query_staging_bytes(config) -> int:
    """The main kernel's fp32 dq staging: per tile query its G rows of head_dim contiguous (one bulk reduction
    per query: the G heads p*G .. p*G + G - 1 are adjacent in dq), then DQ_ROW_PAD floats."""
    queries = config.tile_m // config.group
    return _align(queries * (config.group * config.head_dim + DQ_ROW_PAD) * 4, 1024)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def tile_configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    dts = tuple(dtypes) if dtypes else DTYPES
    ds = matrix.head_dims(head_dims)
    return [Config(dtype=dt, head_dim=d, block_size=bs, group=g, stages=matrix.gather_stages(d, Config.stages))
            for dt in dts for d in ds for bs in matrix.kernel_block_sizes(d, block_sizes) for g in GROUPS]


MMAS = ("sync", "wgmma")


@dataclass(frozen=True)
class MmaConfig(Config):
    """The same tiles plus the products' MMA, for the families that have a wgmma kernel (sparse_bwd_proxy,
    sparse_kl): "sync" (mma.sync, sm90a and sm100a) or "wgmma" (warpgroup MMA, sm90a only)."""

    mma: str = "sync"


def mma_configs(head_dims=None, block_sizes=None, dtypes=None) -> list[MmaConfig]:
    """The backward kernels' tiles and MMAs, which sparse_bwd_proxy and sparse_kl build on (can_implement refuses
    wgmma off sm90a): mma.sync on 64-key slices (two CTAs per key block: 128 keys spill there), wgmma on the whole
    key block (one CTA; dK, dV or dk_p of 128 keys in registers, 255 / 210 registers, no spills). The whole block halves the gathers and the dq reductions per
    FLOP: (b) S = 64K, sparse_bwd 53.5 -> 37.6 ms, sparse_bwd_proxy 31.9 -> 19.5 (NOTES.md)."""
    return [MmaConfig(**dict(dataclasses.asdict(c), tile_n=tile_n_for(m, c.block_size)), mma=m)
            for c in tile_configs(head_dims, block_sizes, dtypes) for m in MMAS]


@dataclass(frozen=True)
class MainConfig(MmaConfig):
    """sparse_bwd's variants: the backward's tiles and MMA plus tau_out = 1, the kernel also writes each entry's
    tau = mean over the G heads of P (the input dtype, one row of block_size keys per plan entry, rows in plan
    order), for the proxy backward that then need not recompute the G main score tiles (sparse_bwd_proxy heads
    "tau"). wgmma on the whole key block only (one CTA holds every key of an entry's row).

    deterministic = 1 (with tau_out = 1): every fp32 sum in a fixed order, so gradients are bitwise identical run
    to run. The kernel stores each entry's dq rows (G x D) at its slot's row of dq_part (entry_dest), which the
    runtime sums over the query's slots in slot order (flash_msa_rt.ops.sparse_bwd_sums); the items of one key
    block add their dK, dV in item order, each waiting for its predecessor's flag (item_prev, item_done)."""

    tau_out: int = 0
    deterministic: int = 0


def tau_ok(config) -> bool:
    return config.mma == "wgmma" and config.tile_n == config.block_size


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[MainConfig]:
    """mma_configs, and the whole-block wgmma ones again with tau_out = 1, atomic and deterministic, and the atomic
    ones at G <= 4 warp-specialised (PRODUCER_THREADS)."""
    base = [MainConfig(**dataclasses.asdict(c)) for c in mma_configs(head_dims, block_sizes, dtypes)]
    tau = [dataclasses.replace(c, tau_out=1, deterministic=d) for d in (0, 1) for c in base if tau_ok(c)]
    return base + tau + [dataclasses.replace(c, threads=PRODUCER_THREADS) for c in tau
                         if not c.deterministic and c.group in PRODUCER_GROUPS]


def tile_n_for(mma: str, block_size: int) -> int:
    """Keys per CTA of the backward kernels: the whole block on wgmma, 64-key slices on mma.sync."""
    return block_size if mma == "wgmma" else 64


def mma_refusal(config, arch: str) -> str | None:
    """Why config's MMA cannot run on arch, or None."""
    mma = getattr(config, "mma", "sync")
    if mma not in MMAS:
        return f"mma {mma!r} not supported; supported: {MMAS}"
    if mma == "wgmma" and arch != "sm90a":
        return f"mma 'wgmma' is Hopper's warpgroup MMA: sm90a only, not {arch}"
    return None


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    c = config
    producer = hasattr(c, "tau_out")  # sparse_bwd's own configs (sparse_bwd_proxy and sparse_kl check theirs)
    reason = refusal(c, arch, dtype=DTYPES, head_dim=matrix.HEAD_DIMS, block_size=matrix.BLOCK_SIZES, group=GROUPS, tile_m=(64,),
                     tile_n=(64, 128), threads=(256, PRODUCER_THREADS) if producer else (256,),
                     stages=(1, 2)) or mma_refusal(c, arch)
    tau_out, det = getattr(c, "tau_out", 0), getattr(c, "deterministic", 0)
    if not reason and c.threads == PRODUCER_THREADS and not (tau_out and not det and c.group in PRODUCER_GROUPS):
        reason = (f"threads {PRODUCER_THREADS} (the producer warp) is built with tau_out 1, deterministic 0 at group "
                  f"in {PRODUCER_GROUPS} only; got tau_out {tau_out}, deterministic {det}, group {c.group}")
    elif not reason and tau_out not in (0, 1):
        reason = f"tau_out {tau_out!r} not supported; supported: 0, 1"
    elif not reason and det not in (0, 1):
        reason = f"deterministic {det!r} not supported; supported: 0, 1"
    elif not reason and det and hasattr(c, "tau_out") and not tau_out:  # (sparse_bwd_proxy checks its own)
        reason = "deterministic 1 is built with tau_out 1 only (the deterministic backward is the tau path)"
    elif not reason and tau_out and not tau_ok(c):
        reason = (f"tau_out 1 needs wgmma on the whole key block (tile_n = block_size); got mma {c.mma!r}, "
                  f"tile_n {c.tile_n}")
    return verdict(reason or smem_refusal(c.smem_bytes(), arch))


def params(config: Config) -> tuple:
    """q, dout, lse, delta, dq: S query rows; k, v, dk, dv: Sk >= S keys (query row i at key position
    Sk - S + i, bottom-right causal alignment)."""
    c = config
    bshd = ("i64", "i64", "i64", 1)
    d = c.head_dim
    return (
        TensorParam("q", c.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("k", c.dtype, ("B", "Sk", "Hk", d), bshd, align=16),
        TensorParam("v", c.dtype, ("B", "Sk", "Hk", d), bshd, align=16),
        TensorParam("dout", c.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("lse", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        TensorParam("delta", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        TensorParam("entry_query", "i32", ("E",), (1,), align=4),
        TensorParam("items", "i32", ("W", 4), (4, 1), align=16),
        *gradient_params(c, ("dq", "H"), ("dk", "Hk"), ("dv", "Hk")),
        *tau_params(c),
        *turn_params(c),
        ScalarParam("scale", "f32"),
        ScalarParam("hp", "i32"),  # proxy heads: item bp = b * Hp + p
        ScalarParam("hp_per_hk", "i32"),
    )


def gradient_params(config, dq, *dkv) -> tuple:
    """The fp32 gradient buffers, (name, heads) each: accumulators (B, S or, for the keys' dkv, Sk, heads, D) that
    the kernel adds to, except
    with deterministic = 1 the query gradient's partial rows that it stores, one per plan entry ((E, G D): the
    query's G heads), at its slot's row)."""
    d = config.head_dim
    bshd = ("i64", "i64", "i64", 1)
    acc = tuple(TensorParam(f"{name}_acc", "f32", ("B", "Sk", heads, d), bshd, align=16) for name, heads in dkv)
    if getattr(config, "deterministic", 0):
        return (TensorParam(f"{dq[0]}_part", "f32", ("E", config.group * d), (config.group * d, 1), align=16), *acc)
    return (TensorParam(f"{dq[0]}_acc", "f32", ("B", "S", dq[1], d), bshd, align=16), *acc)


def turn_params(config) -> tuple:
    """deterministic = 1: per plan entry, the flat (b, p, i, slot) row of its partial dq rows (the plan's
    entry_dest: a query's slots are adjacent rows for the runtime's sum); per item, the item before it on the same
    key-block rows (-1: none) and the flag it raises once its atomics are done (zeros at launch)."""
    if not getattr(config, "deterministic", 0):
        return ()
    return (TensorParam("entry_dest", "i32", ("E",), (1,), align=4),
            TensorParam("item_prev", "i32", ("W",), (1,), align=4),
            TensorParam("item_done", "i32", ("W",), (1,), align=4))


def tau_params(config) -> tuple:
    """tau (E, block_size) in the input dtype, rows in plan order, where the kernel writes it (tau_out = 1); its
    16-byte rows are what the proxy backward gathers a tile of."""
    if not getattr(config, "tau_out", 0):
        return ()
    return (TensorParam("tau", config.dtype, ("E", config.block_size), (config.block_size, 1), align=16),)


def build_set(config, arch: str) -> str:
    """On wgmma the default paths run: tau_out 0 (one gradient wanted; the block-sparse backward), tau_out 1 with
    the producer warpgroup at G in PRODUCER_GROUPS and without it above, and the deterministic variants. The
    256-thread tau_out kernel at G in PRODUCER_GROUPS is the producer's A/B alternate."""
    c = config
    if c.mma == "wgmma" and c.tau_out and not c.deterministic and c.group in PRODUCER_GROUPS and \
            c.threads != PRODUCER_THREADS:
        return OPT_IN
    return mma_set(c.mma, arch)


def build_spec(config: Config, arch: str) -> BuildSpec:
    # one CTA per (item, key slice)
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"W * {config.block_size // config.tile_n}", "1", "1"),
                       compile_fn="kernels_src.sparse_bwd.build:compile", smem_bytes=config.smem_bytes())
