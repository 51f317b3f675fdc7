"""MSA selection: top-K key blocks per (b, p, i) from the causal proxy scores (msa-semantics.md, "Selection").

block_indices[b, p, i, :] = the forced blocks F(i) = {blk(i), ..., blk(i) - L + 1} (those >= 0; blk(i) the local
block, L = local_blocks, a runtime scalar) plus the K - |F(i)| blocks j < blk(i) - L + 1 with the largest block score
c_p(i, j) = max over t in block j of scale * <q_proxy[b, i, p], k_proxy[b, t, p // group]>, ties to the smaller j,
ascending, -1 for empty slots. The score tiles are those of block_scores (same TMA + mma.sync pipeline, same
grid); instead of storing every block score, each thread keeps one query row's K - L best blocks in shared memory
and a register threshold, so the output is O(B * Hp * S * K) and no (S, S / Bs) score matrix ever exists.

This module does not import cutlass; the kernel lives in kernels_src.select.kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, variant_name
from kernels_src.block_scores import ELEM_BYTES, proxy_operands
from kernels_src import matrix
from kernels_src.spec import OPT_IN, BuildSpec, family_spec, mma_set, refusal, smem_refusal, verdict

OP = "select"

# "e4m3": fp8 selection (select_precision="fp8"): q_proxy and k_proxy quantised to float8 e4m3 with power-of-two
# scales (flash_msa_rt.reference.fp8), on wgmma only; k_scale holds each key block's scale.
DTYPES = ("bf16", "f16", "e4m3")
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64, 128)
MAX_KS = (16, 32, 64)  # slots kept per row (K <= max_k at run time); 16 covers top_k = 2048 at Bs = 128
MAX_BLOCKS = 1 << 15  # slot block indices are int16 in shared memory: S < 32768 * Bs


@dataclass(frozen=True)
class Config:
    """Every codegen choice of one variant, in naming order."""

    dtype: str = "bf16"
    head_dim: int = 128  # Dp
    block_size: int = 128  # Bs
    max_k: int = 16  # the most blocks per row this variant can select (shared-memory slots per row)
    tile_m: int = 128  # query rows per CTA: one row per thread
    threads: int = 128
    stages: int = 2  # K-block buffers (TMA double buffering)
    # the score tiles' MMA: "sync" (mma.sync, sm90a and sm100a) or "wgmma" (one warpgroup's m64 x Bs products
    # on shared-memory descriptors, sm90a only: kernels_src/select/wgmma.py)
    mma: str = "sync"
    # "block": one key block per loop step; "pairs" (e4m3 on wgmma, 4 stages): two per step, block j + 1's
    # products issued while block j's second half is reduced (kernels_src/select/wgmma.py, ProxySelectWGPairs);
    # "wide" (blocks of 64 on wgmma): two per step scored as one block of 128 (ProxySelectWGWide)
    schedule: str = "block"

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)

    def smem_bytes(self) -> int:
        """mbarriers and the per-row slots (fp32 score + int16 block, slot-major so a warp's rows hit distinct
        banks), then sQ and the staged sK, each 1024-aligned. Mirrors the kernel's SharedStorage."""
        e = ELEM_BYTES[self.dtype]
        head = (1 + self.stages) * 8
        head = _align(head, 4) + self.max_k * self.tile_m * 4
        head = _align(head, 2) + self.max_k * self.tile_m * 2
        s_q = _align(self.tile_m * self.head_dim * e, 1024)
        s_k = _align(self.stages * self.step_keys() * self.head_dim * e, 1024)
        return _align(head, 1024) + s_q + s_k


    def step_keys(self) -> int:
        """Keys a loop step loads into one K stage and scores: the block, or two blocks of 64 in "wide"."""
        return WIDE_STEP_KEYS if self.schedule == "wide" else self.block_size


WIDE_STEP_KEYS = 128


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


MMAS = ("sync", "wgmma")
SCHEDULES = ("block", "pairs", "wide")
PAIRS_STAGES = 4  # the pair in use and the next pair in flight


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """The default set: bf16 and f16, Dp 128 and 64 (a smaller proxy is the other way to cheapen selection), Bs 128,
    max_k 16 (top_k <= 2048) and 64 (top_k <= 8192), on both MMAs (can_implement keeps wgmma to sm90a); fp8
    (e4m3) on wgmma; the opt-in schedules ("pairs" for fp8, "wide" at blocks of 64). An explicit dtypes choice of
    bf16 or f16 brings the fp8 variants along: fp8 selection runs on bf16 and f16 inputs alike."""
    dts = tuple(dtypes) if dtypes else DTYPES
    if dtypes and "e4m3" not in dts:
        dts += ("e4m3",)
    dps = matrix.proxy_head_dims(head_dims)
    bss = matrix.block_sizes(block_sizes)
    base = [Config(dtype=dt, head_dim=dp, block_size=bs, max_k=k, mma=m)
            for dt in dts for dp in dps for bs in bss for k in (16, 64) for m in MMAS
            if not (dt == "e4m3" and m != "wgmma")]
    pairs = [dataclasses.replace(c, schedule="pairs", stages=PAIRS_STAGES) for c in base if c.dtype == "e4m3"]
    wide = [dataclasses.replace(c, schedule="wide") for c in base
            if c.mma == "wgmma" and 2 * c.block_size == WIDE_STEP_KEYS]
    return base + pairs + wide


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    c = config
    reason = refusal(c, arch, dtype=DTYPES, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES, max_k=MAX_KS, tile_m=(128,),
                     threads=(128,), stages=(2, 3, PAIRS_STAGES), mma=MMAS, schedule=SCHEDULES,
                     notes={"head_dim": "Dp", "block_size": "Bs", "tile_m": "each thread owns one query row",
                            "threads": "each thread owns one query row"})
    if reason is None and c.mma == "wgmma" and arch != "sm90a":
        reason = f"mma 'wgmma' is Hopper's warpgroup MMA: sm90a only, not {arch}"
    if reason is None and c.dtype == "e4m3" and c.mma != "wgmma":
        reason = f"dtype 'e4m3' (fp8 selection) runs on mma 'wgmma' only, not {c.mma!r}"
    if reason is None and c.schedule == "pairs" and (c.dtype, c.mma, c.stages) != ("e4m3", "wgmma", PAIRS_STAGES):
        reason = (f"schedule 'pairs' is built for dtype 'e4m3' on mma 'wgmma' with {PAIRS_STAGES} stages, not "
                  f"{c.dtype!r} / {c.mma!r} / {c.stages}")
    half = WIDE_STEP_KEYS // 2
    if reason is None and c.schedule == "wide" and (c.mma, c.block_size, c.stages) != ("wgmma", half, 2):
        reason = (f"schedule 'wide' (two blocks of {half} per {WIDE_STEP_KEYS}-key step) is built on mma 'wgmma' "
                  f"with 2 stages at block_size {half}, not mma {c.mma!r}, stages {c.stages}, "
                  f"block_size {c.block_size}")
    return verdict(reason or smem_refusal(c.smem_bytes(), arch))


def params(config: Config) -> tuple:
    """The kernel param ABI, in PTX .param order. K is block_indices.shape[3]; the op checks K <= max_k and the
    kernel clamps to it as well. q_proxy, k_proxy and their descriptors are block_scores' (compile() checks
    CuTeDSL's descriptor basis against them). fp8 (e4m3) variants also take k_scale (B, NB, Hpk): the power-of-two
    scale of each key block of k_proxy (NB = ceil(Sk / Bs)), by which a block's scores are multiplied. k_proxy's
    length Sk may exceed the queries' S: query row i sits at key position Sk - S + i (bottom-right causal
    alignment, the reference's), which is how a chunk of a sequence selects against its whole prefix. local_blocks
    (L, 1 <= L <= K, checked by the op; the kernel clamps it to [1, min(K, max_k)]) is the number of forced blocks
    per row: a runtime scalar, so every L runs on the same variants."""
    o = proxy_operands(config, key_len="Sk")
    if config.step_keys() != config.block_size:  # "wide": a K box holds a step's keys, two blocks
        box = o["tma_k"].box
        o["tma_k"] = dataclasses.replace(o["tma_k"], box=(box[0], config.step_keys(), *box[2:]))
    block_indices = TensorParam("block_indices", "i32", ("B", "Hp", "S", "K"), ("i64", "i64", "i64", 1), align=4)
    k_scale = (TensorParam("k_scale", "f32", ("B", "NB", "Hpk"), ("i64", "i64", 1), align=4),) if is_fp8(config) else ()
    return (o["q_proxy"], o["k_proxy"], block_indices, *k_scale, ScalarParam("scale", "f32"),
            ScalarParam("group", "i32"), ScalarParam("local_blocks", "i32"), o["tma_q"], o["tma_q_coord"], o["tma_k"],
            o["tma_k_coord"])


def is_fp8(config: Config) -> bool:
    return config.dtype == "e4m3"


def build_set(config: Config, arch: str) -> str:
    """max_k 16 and 64 are the default paths' (the smallest that holds top_k runs); the MMA decides the rest. The
    pairs and wide schedules are opt-in until they have run on the GPU (tuning.select)."""
    if config.schedule in ("pairs", "wide"):
        return OPT_IN
    return mma_set(config.mma, arch)


def build_spec(config: Config, arch: str) -> BuildSpec:
    # query tiles of one head side by side: K shared in L2
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"ceil_div(S, {config.tile_m})", "Hp", "B"),
                       compile_fn="kernels_src.select.build:compile", smem_bytes=config.smem_bytes())
