"""Proxy block scores: stage 1 of MSA selection (see docs/msa-semantics.md, "Selection").

scores[b, p, i, j] = max over keys t of block j with t <= i of scale * <q_proxy[b, i, p], k_proxy[b, t, p // group]>,
-inf for j > i // Bs. One CTA per (query tile, proxy head, batch); TMA loads, warp-level mma.sync math, so the same
source compiles for sm90a and sm100a; on sm90a the score tiles also build on wgmma (kernels_src/block_scores/
wgmma.py, which select shares).

This module does not import cutlass: the catalogue enumerates it on machines without the DSL. The kernel and its
compile function live in kernels_src.block_scores.kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, TmaCoordParam, TmaParam, variant_name
from kernels_src import matrix
from kernels_src.spec import BuildSpec, family_spec, mma_set, refusal, smem_refusal, verdict

OP = "block_scores"

DTYPES = ("bf16",)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64, 128)
TILE_MS = (128,)

# TMA with 128-byte swizzle moves at most 128 bytes of the innermost dim per box row: 64 bf16 elements, 128 fp8.
SWIZZLE_BYTES = 128
ELEM_BYTES = {"bf16": 2, "f16": 2, "e4m3": 1}


def swizzle_bytes(dtype: str, head_dim: int) -> int:
    """The swizzle of the proxy tiles: 128 bytes, or a whole Dp row where it is narrower (an e4m3 row at Dp 64 is
    64 bytes: a 128-byte box would be wider than the tensor, so those tiles take the 64-byte swizzle, which TMA and
    wgmma's K-major descriptors both have)."""
    return min(SWIZZLE_BYTES, head_dim * ELEM_BYTES[dtype])


def swizzle_elems(dtype: str, head_dim: int) -> int:
    """Elements of one swizzled box row: the TMA box's innermost extent."""
    return swizzle_bytes(dtype, head_dim) // ELEM_BYTES[dtype]


@dataclass(frozen=True)
class Config:
    """Every codegen choice of one variant, in naming order."""

    dtype: str = "bf16"
    head_dim: int = 128  # Dp, static in the cubin
    block_size: int = 128  # Bs, the key block
    tile_m: int = 128  # query rows per CTA
    threads: int = 128  # 4 warps, each owns tile_m / 4 query rows and all Bs keys of a block
    stages: int = 2  # K-block buffers in shared memory (TMA double buffering)
    # the score tiles' MMA: "sync" (mma.sync, sm90a and sm100a) or "wgmma" (one warpgroup's m64 x Bs products on
    # shared-memory descriptors, sm90a only: kernels_src/block_scores/wgmma.py)
    mma: str = "sync"

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)

    @property
    def warps(self) -> int:
        return self.threads // 32

    def smem_bytes(self) -> int:
        """Dynamic shared memory: mbarriers, then sQ and the staged sK, each 1024-aligned (128B-swizzle atoms).

        Mirrors the SharedStorage struct of the kernel; compile() checks the two agree.
        """
        e = ELEM_BYTES[self.dtype]
        barriers = _align((1 + self.stages) * 8, 1024)
        s_q = _align(self.tile_m * self.head_dim * e, 1024)
        s_k = _align(self.stages * self.block_size * self.head_dim * e, 1024)
        return barriers + s_q + s_k


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


MMAS = ("sync", "wgmma")


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """The variant matrix; the default set (every choice None) is bf16, Dp in (128, 64), Bs 128, on both MMAs
    (can_implement keeps wgmma to sm90a)."""
    dts = tuple(dtypes) if dtypes else ("bf16",)
    dps = matrix.proxy_head_dims(head_dims)
    bss = matrix.block_sizes(block_sizes)
    return [Config(dtype=dt, head_dim=dp, block_size=bs, mma=m) for dt in dts for dp in dps for bs in bss
            for m in MMAS]


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    c = config
    reason = refusal(c, arch, dtype=DTYPES, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES, tile_m=TILE_MS,
                     threads=(128,), stages=(2, 3), mma=MMAS,
                     notes={"head_dim": "Dp", "block_size": "Bs",
                            "threads": "4 warps x 32 rows: each lane of a quad stores one row"})
    if reason is None and c.mma == "wgmma" and arch != "sm90a":
        reason = f"mma 'wgmma' is Hopper's warpgroup MMA: sm90a only, not {arch}"
    if reason is None and c.tile_m % c.block_size != 0:
        reason = f"tile_m {c.tile_m} must be a multiple of block_size {c.block_size} (tiles start on block edges)"
    return verdict(reason or smem_refusal(c.smem_bytes(), arch))


def proxy_operands(config, key_len: str = "S") -> dict:
    """The declared q_proxy / k_proxy tensors and their TMA descriptors: shared by every kernel built on the
    proxy score tiles (block_scores, select), so their ABI and descriptor recipe are written once. key_len: the
    symbol of k_proxy's length, "S" where it must equal the queries' (block_scores), "Sk" where the keys may be
    longer (select: the queries are the last S of Sk positions)."""
    c = config
    dp = c.head_dim
    # The descriptor CuTeDSL builds for a (1, rows, 1, Dp) box over (B, S, H, Dp): its TMA basis is
    # (64, rows, 1, 1):(1@3, 1@1, 1@0, 1@2), i.e. dims Dp, S, B, H innermost first, 128-byte-wide Dp boxes (128B
    # swizzle: 64 bf16 or 128 fp8 elements; 64B boxes and swizzle for e4m3 at Dp 64: swizzle_bytes), Dp / box
    # copies per tile. compile() reads the basis back from the atom and checks it equals this.
    sw = swizzle_bytes(c.dtype, dp)
    return {
        "q_proxy": TensorParam("q_proxy", c.dtype, ("B", "S", "Hp", dp), ("i64", "i64", "i64", 1), align=16),
        "k_proxy": TensorParam("k_proxy", c.dtype, ("B", key_len, "Hpk", dp), ("i64", "i64", "i64", 1), align=16),
        "tma_q": TmaParam("tma_q", "q_proxy", dims=(3, 1, 0, 2), box=(swizzle_elems(c.dtype, dp), c.tile_m, 1, 1),
                          swizzle=sw),
        "tma_q_coord": TmaCoordParam("tma_q_coord", "q_proxy", dynamic_modes=3),  # (B, S, Hp) in tensor mode order
        "tma_k": TmaParam("tma_k", "k_proxy", dims=(3, 1, 0, 2), box=(swizzle_elems(c.dtype, dp), c.block_size, 1, 1),
                          swizzle=sw),
        "tma_k_coord": TmaCoordParam("tma_k_coord", "k_proxy", dynamic_modes=3),  # (B, S, Hpk)
    }


def params(config: Config) -> tuple:
    """The kernel param ABI, in the order of the PTX .param list (the @cute.kernel argument order)."""
    o = proxy_operands(config)
    scores = TensorParam("scores", "f32", ("B", "Hp", "S", "NB"), ("i64", "i64", "i64", 1), align=4)
    return (o["q_proxy"], o["k_proxy"], scores, ScalarParam("scale", "f32"), ScalarParam("group", "i32"),
            o["tma_q"], o["tma_q_coord"], o["tma_k"], o["tma_k_coord"])


def build_set(config: Config, arch: str) -> str:
    """Both head dims are default paths (proxy_block_scores takes Dp 64 and 128); the MMA decides the rest."""
    return mma_set(config.mma, arch)


def build_spec(config: Config, arch: str) -> BuildSpec:
    # x fastest: the query tiles of one (head, batch) run side by side and share that head's k_proxy in L2.
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"ceil_div(S, {config.tile_m})", "Hp", "B"),
                       compile_fn="kernels_src.block_scores.build:compile", smem_bytes=config.smem_bytes())
