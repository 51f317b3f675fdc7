"""The reverse index of a selection on the GPU: every chunk's entries sorted by list, and the lists' bounds.

What it replaces. flash_msa_rt.ops.sparse_plan.chunk_plans sorted B * Hp * S * K int32 list ids with torch's
stable radix sort and decoded the order with ~30 more torch ops: at configuration (b), S = 64K, B = 2 ~1.2 ms of
GPU time per plan (the forward and the backward plan once each), and at (a) B = 1, S = 8K-16K ~0.9 ms of host
enqueue per plan, where the op is host-bound (kernels_src/sparse_fwd/NOTES.md).

How. The sort is a counting sort whose ranks need no atomics on global memory and no second sort:
  - a tile is 128 query rows of one (b, p) (one thread per row); all its entries belong to one chunk (chunks are
    whole head groups x multiples of 128 queries);
  - keys are chunk-major: a chunk's live lists (b, p', j) in (b, p', j) order, then one dead list per (b, p') of
    the chunk, so the dead entries come last in (b, p', query, slot) order, which is exactly where torch's stable
    sort on one dead key per chunk put them;
  - each thread loads its row's K slots once, into registers (max_k of them: every pass below is unrolled over
    them, so the loads are issued together instead of one dependent global load per slot and pass: the first
    build looped over K and its scatter took 0.77 ms per (b) 64K plan);
  - `count` (phase 1): per tile a shared bitmap [block][128 rows] (one bit per row that chose the block; a row
    holds a block at most once) gives each list's count in the tile by popc; the counts go to a (key, tile)
    matrix, key-major, so that one inclusive torch.cumsum over it gives every (key, tile) its end position;
  - `scatter` (phase 2): the same bitmap gives an entry's rank among the tile's entries of its list (the rows
    below it in the block's bitmap), so its position is cumsum - count + rank: the list's entries stay sorted by
    query, as the kernels' tiles and the causal test of the first tile assume (each block's cumsum - count is
    read once per tile, into shared memory). Dead slots rank by a prefix sum over the tile's rows. The tile with
    each (b, p') chunk's first rows also writes its lists' starts and counts. The entries are ranked into shared
    memory in list order first and stored by consecutive threads, so a list's entries leave in runs; a scatter
    CTA takes one or four tiles (`threads` 128 / 512: longer runs), the count always one.
Blocks are taken in windows (window_blocks: 16 KB of bitmap), so any S works.
This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, variant_name
from kernels_src import matrix
from kernels_src.spec import DEFAULT, OPT_IN, BuildSpec, family_spec, refusal, verdict

OP = "plan_lists"

BLOCK_SIZES = (64, 128)
PHASES = ("count", "scatter")
TILE_ROWS = 128  # query rows per tile (a column of the (key, tile) count matrices)
SCATTER_THREADS = (128, 512)  # rows (threads) per scatter CTA: 1 or 4 tiles; 512 with max_k 16 only (shared memory)


MAX_KS = (16, 64)  # slots per row a variant holds in registers (K <= max_k; the runtime picks the smallest)


@dataclass(frozen=True)
class Config:
    block_size: int = 128  # the live rule j <= i // Bs and the lists per chunk
    max_k: int = 16
    phase: str = "count"
    threads: int = TILE_ROWS

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list:
    """The plan reads int32 indices only; built where a sparse forward it serves is (see sparse_combine_kl):
    count and scatter (Config), and the items cut (ItemsConfig)."""
    from kernels_src import sparse_fwd

    if head_dims and not set(head_dims) & set(sparse_fwd.HEAD_DIMS) or \
            dtypes and not set(dtypes) & set(sparse_fwd.DTYPES):
        return []
    bss = matrix.any_kernel_block_sizes(head_dims, block_sizes)
    return [Config(block_size=bs, max_k=mk, phase=ph, threads=t) for bs in bss for mk in MAX_KS for ph in PHASES
            for t in (SCATTER_THREADS if ph == "scatter" else (TILE_ROWS,)) if t == TILE_ROWS or mk == MAX_KS[0]] + \
        [ItemsConfig(block_size=bs) for bs in bss]


def can_implement(config, arch: str) -> tuple[bool, str]:
    if isinstance(config, ItemsConfig):
        return verdict(refusal(config, arch, block_size=BLOCK_SIZES, threads=(ITEM_THREADS,)))
    threads = SCATTER_THREADS if config.phase == "scatter" and config.max_k == MAX_KS[0] else (TILE_ROWS,)
    return verdict(refusal(config, arch, block_size=BLOCK_SIZES, max_k=MAX_KS, phase=PHASES, threads=threads,
                           notes={"threads": "one thread per query row: the count takes 128-row tiles, the scatter "
                                             "128 or (max_k 16) 512 rows"}))


def _scalars() -> tuple:
    return (
        ScalarParam("heads", "i32"),  # proxy heads per chunk (c): divides Hp
        ScalarParam("queries", "i32"),  # queries per chunk (Q): a multiple of 128, or >= S (one query chunk)
        ScalarParam("tiles", "i32"),  # columns of the (key, tile) matrices: ceil(min(Q, S) / 128)
    )


def params(config: Config) -> tuple:
    sel = TensorParam("block_indices", "i32", ("B", "Hp", "S", "K"), ("i64", "i64", "i64", 1), align=4)
    counts = TensorParam("counts", "i32", ("N",), (1,), align=4)
    if config.phase == "count":
        return (sel, counts, *_scalars())
    return (
        sel, counts,
        TensorParam("ends", "i32", ("N",), (1,), align=4),  # inclusive cumsum of counts
        TensorParam("entry_query", "i32", ("E",), (1,), align=4),
        TensorParam("entry_dest", "i32", ("E",), (1,), align=4),
        TensorParam("lists", "i64", ("C", 2, "L"), ("i64", "i64", 1), align=8),  # per chunk: starts, counts
        *_scalars(),
    )


def window_blocks(config: Config) -> int:
    """Blocks per bitmap window: a window is one pass over the rows' slots; 4 x 1024 words at 128 rows (16 KB),
    16 x 256 at 512 (two CTAs of 512 rows per SM)."""
    return 1024 if config.threads == TILE_ROWS else 256


def smem_bytes(config: Config) -> int:
    """count: the bitmap, the rows' slots (padded), the warps' sums. scatter: the bitmap and its per-word
    prefixes, each (tile, block)'s base and each block's first position in the CTA, the stage (two words per entry
    of a window, the rows' slots before), each row's first entry_dest, the warps' sums. Every range is a multiple
    of 16 bytes."""
    warps, win = config.threads // 32, window_blocks(config)

    def r16(words):
        return -(-4 * words // 16) * 16

    if config.phase == "count":
        return r16(warps * win) + r16(config.threads * (config.max_k + 1)) + r16(warps)
    return (2 * r16(warps * win) + r16(config.threads // TILE_ROWS * win) + r16(win)
            + r16(2 * config.threads * config.max_k) + r16(config.threads) + r16(warps))


def build_set(config, arch: str) -> str:
    """The scatter runs 512 rows per CTA at max_k 16 (SCATTER_THREADS[-1]; max_k 64 has 128 only); 128 rows at
    max_k 16 is kept for A/B runs. Count and the items cut always run."""
    if getattr(config, "phase", None) == "scatter" and config.max_k == MAX_KS[0] and \
            config.threads != SCATTER_THREADS[-1]:
        return OPT_IN
    return DEFAULT


def build_spec(config, arch: str) -> BuildSpec:
    if isinstance(config, ItemsConfig):
        return family_spec(ITEMS_OP, config, arch, can_implement, params=item_params(config),
                           grid=("C", "U", "1"), compile_fn="kernels_src.plan_lists.build:compile_items",
                           smem_bytes=4 * (ITEM_THREADS // 32))
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"B * Hp * ceil_div(S, {config.threads})", "1", "1"),
                       compile_fn="kernels_src.plan_lists.build:compile", smem_bytes=smem_bytes(config))


# --- phase 3: the lists cut into work items -------------------------------------------------------------------

ITEM_THREADS = 512


@dataclass(frozen=True)
class ItemsConfig:
    """plan_items: every chunk's lists (phase 2's table) cut into items of at most `entries` entries, for up to two
    cuts at once (the forward's kernel and its KL pass, the backward's and its proxy kernel): one CTA per (chunk,
    cut) scans its lists' item counts and writes (bp, j, entry_start, n_entries) per item, zeros past the real
    count. Replaces ~25 torch ops per plan (sparse_plan._cut_batched, still the CPU path and the reference)."""

    block_size: int = 128
    threads: int = ITEM_THREADS

    def variant_name(self, arch: str) -> str:
        return variant_name(ITEMS_OP, dataclasses.asdict(self), arch)


ITEMS_OP = "plan_items"


def item_params(config: ItemsConfig) -> tuple:
    return (
        TensorParam("lists", "i64", ("C", 2, "L"), ("i64", "i64", 1), align=8),
        TensorParam("items", "i32", ("U", "C", "W", 4), ("i64", "i64", "i64", 1), align=16),
        TensorParam("item_count", "i32", ("U", "C"), ("i64", 1), align=4),
        ScalarParam("seqlen", "i32"),  # S: chunk n's blocks NB = ceil(min(S, (n % n_q + 1) Q) / Bs)
        ScalarParam("queries", "i32"),  # Q
        ScalarParam("lists_per_block", "i32"),  # B c: a chunk holds B c NB lists
        ScalarParam("entries0", "i32"),  # entries per item of cut 0
        ScalarParam("entries1", "i32"),  # ... of cut 1 (unused with one cut)
    )
