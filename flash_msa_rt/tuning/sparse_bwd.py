"""Tuning policy of the MSA sparse backward (flash_msa_rt.ops.sparse_bwd): its kernels' variants and how the
backward cuts its work."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.head_dim import wide
from flash_msa_rt.tuning.mma import default_mma
from flash_msa_rt.tuning.overrides import Overrides, current, register
from flash_msa_rt.tuning.problem import Problem

TILE_M = 64  # rows per tile of both backward kernels
ITEM_ENTRIES = 2048  # the main kernel's shared entry table: an item's entries past it take a slower global read
PRODUCER_THREADS = 384  # the warp-specialised main kernel: a producer warpgroup beside the two MMA warpgroups
PRODUCER_GROUPS = (1, 2, 4)
QUERY_BIN_ROWS = 1 << 21  # proxy rows B Hp S from which the backward's items run in query bins at every G
RESIDENT_GROUPS = (1, 2, 4)  # the proxy kernel holds the G head tiles at once up to G = 4
SMALL_STEP_ROWS = 1 << 15  # proxy rows B Hp S up to which every kernel's items are a quarter of their usual size


@dataclass(frozen=True)
class SparseBwdTuning:
    mma: str  # sparse_bwd's MMA
    proxy_mma: str  # sparse_bwd_proxy's MMA
    tau_path: bool  # with both gradients, the main kernel writes tau and the proxy kernel reads it
    recompute_heads: str  # otherwise the proxy kernel recomputes tau: "resident" (G heads at once) or "stepped"
    producer: bool  # the warp-specialised main kernel on the atomic tau path where it is built
    tiles_per_item: int  # main kernel: tiles of TILE_M // G queries per work item
    proxy_tiles_per_item: int  # proxy kernel: tiles of 64 queries x G heads per work item
    item_order: str  # chunk_plans' order of the items (the deterministic kernels always take "list")
    bin_queries: int  # item order "bins": queries per bin, so that one bin's fp32 dq rows fit the L2 with room
    tau_budget: int  # bytes of tau rows per chunk of the tau path
    accumulator_budget: int  # bytes of fp32 query-gradient accumulators (dq, dq_proxy) per chunk of the tau path
    deterministic_budget: int  # bytes of tau and partial dq rows per chunk of the deterministic tau path
    plan_entries: int  # (b, p, i, slot) entries per plan of the proxy backward alone (warmup's all-causal selection)


register("sparse_bwd", SparseBwdTuning)


def choose(arch: str, problem: Problem = Problem()) -> SparseBwdTuning:
    return _choose(arch, problem, current())


def keys_per_cta(mma: str, block_size: int) -> int:
    # The whole key block on wgmma (dK, dV or dk_p of 128 keys in registers): (b) S = 64K sparse_bwd 53.5 -> 37.6
    # ms, sparse_bwd_proxy 31.9 -> 19.5 against two CTAs of 64 keys; mma.sync spills at 128 keys: 64-key slices.
    return block_size if mma == "wgmma" else 64


def small_step(p: Problem) -> bool:
    """A problem whose plans make too few work items to fill the GPU at the usual item sizes (sizes known)."""
    return 0 < p.proxy_rows <= SMALL_STEP_ROWS


def per_group_tiles(main_tiles: int, group: int) -> int:
    """Tiles per item for kernels whose tile visits the G heads in turn (KL pass, proxy backward): about
    main_tiles // G, between 1 and 32."""
    return max(1, min(32, main_tiles // group))


def _item_order(p: Problem) -> str:
    if p.block_size == 64 and not wide(p.head_dim):
        return "bins"
    return "query" if p.group >= 16 or p.proxy_rows >= QUERY_BIN_ROWS or wide(p.head_dim) else "list"


@functools.lru_cache(maxsize=256)
def _choose(arch: str, p: Problem, overrides: Overrides) -> SparseBwdTuning:
    o = overrides.fields("sparse_bwd")
    mma = o.get("mma", default_mma(arch))
    proxy_mma = o.get("proxy_mma", default_mma(arch))
    wgmma = mma == proxy_mma == "wgmma"
    G = p.group
    # Resident heads hold the G head tiles at once: at D 256 they need more shared memory than sm90a has.
    resident = "resident" if proxy_mma == "wgmma" and G in RESIDENT_GROUPS and not wide(p.head_dim) else "stepped"
    return SparseBwdTuning(
        mma=mma, proxy_mma=proxy_mma,
        # Reading tau instead of recomputing the G main score tiles needs both kernels on whole key blocks (wgmma).
        tau_path=o.get("tau_path", wgmma),
        recompute_heads=o.get("recompute_heads", resident),
        # Warp-specialised main kernel: 1.04-1.07x on the whole backward, GPU tests and four sanitizers clean.
        producer=o.get("producer", True),
        # 64 tiles against 32, whole backward (b) / (a) / (c) 64K and (a) B = 1 64K: 42.71 -> 41.68, 21.39 -> 20.89,
        # 76.09 -> 74.26, 13.62 -> 13.20 ms; G = 1 stops at the entry table (32 tiles). Small steps take a quarter
        # (tuning.sparse_fwd's tiles_per_item cites the measurement).
        tiles_per_item=o.get("tiles_per_item", max(1, min(16 if small_step(p) else 64,
                                                           ITEM_ENTRIES // max(1, TILE_M // G)))),
        # sweep at (b) 64K: sparse_bwd_proxy 20.13 / 19.52 / 19.30 ms at 8 / 16 / 32 tiles per item; small steps
        # a quarter (as tiles_per_item). The plans that recompute tau only: the tau path (the default with both
        # gradients) cuts its proxy items at a fixed 32 tiles of one head (ops.sparse_bwd._backward_with_tau), so
        # the sweep's "proxy backward 8 / 16" rows (docs/compile.md) ran that path's default cut.
        proxy_tiles_per_item=o.get("proxy_tiles_per_item", per_group_tiles(32 if small_step(p) else 128, G)),
        # Query bins of 2048 against list order: (c) 64K (G = 16) 76.48 -> 73.57 ms; (a) 64K (G = 4) 2.5-5 % slower;
        # from 2M proxy rows B Hp S (the fp32 dq rows of a head chunk far past the L2) faster again: (b) B = 1
        # 256K 89.2-91.9 -> 86.1-87.6 ms, 1M 394.5-398.8 -> 388.7-391.0 (msa_backward_cuda, interleaved, cf5c1b0).
        # At D 256 (two 64-key items per block of 128, each reducing the same dq rows) at every size: (b) D 256,
        # B = 1, 64K, whole fwd + bwd 122.9 -> 117.3 ms (sweep_small, H100, c422079).
        # Lists cut at query bins ("bins") at key blocks of 64 (D <= 128), where twice the (query, block) entries
        # reduce into the same dq rows: (b) B = 1, 64K, D 128, Bs 64, whole graphed fwd + bwd 73.21 -> 67.67 ms
        # (3.10x -> 3.36x cuDNN dense); at blocks of 128 it lost: D 128 41.44 -> 45.83, D 256 (64-key halves,
        # query bins) 117.33 -> 125.61 (benchmarks/results/sweep_bins.json, H100, 5ebc287).
        item_order=o.get("item_order", _item_order(p)),
        # Item order "bins" (sparse_plan.chunk_plans): one bin's fp32 dq rows, G D 4 bytes per query, about 8 MiB,
        # so that the CTAs resident at once, spread over a bin or two of a head, reduce into rows the L2 holds.
        bin_queries=o.get("bin_queries", max(1024, (8 << 20) // (G * p.head_dim * 4))),
        # 1 GiB floor and cap: at (a) B = 1, S = 64K 4 chunks took 12.3-13.0 ms, 1 chunk 11.0.
        tau_budget=o.get("tau_budget", max(1 << 30, min(1 << 30, p.dq_bytes // 2))),
        # The fp32 accumulators live for their head chunk only (sparse_bwd._ChunkGradients), so this bounds the
        # backward's fp32 whatever S. 4 GiB binds after tau_budget at top_k 2048 in (a), (b) and (c) (per head and
        # query 2.5 / 2.5 / 8.5 KB of accumulators against 4 KB of tau rows): the chunks, and so the host work
        # measured for tau_budget, are unchanged; at (b) 1M the backward then holds 4 GiB of fp32, not 28.5.
        accumulator_budget=o.get("accumulator_budget", 4 << 30),
        # Twice the dq accumulator in [2, 4] GiB: each chunk costs ~2 ms of host work; at 1 GiB (a) B = 1, S = 32K
        # ran 8 chunks, host-bound at 4.5x the GPU time.
        deterministic_budget=o.get("deterministic_budget", max(1 << 31, min(1 << 32, 2 * p.dq_bytes))),
        plan_entries=o.get("plan_entries", 1 << 26),  # 512 MiB of plan: bounds warmup's O(S^2 / Bs) selection
    )
