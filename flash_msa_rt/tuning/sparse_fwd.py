"""Tuning policy of the MSA sparse forward (flash_msa_rt.ops.sparse_fwd): its kernels' variants (forward, combine,
KL pass) and how the forward cuts its work."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.head_dim import forward_stages, gather_stages, wide
from flash_msa_rt.tuning.mma import default_mma
from flash_msa_rt.tuning.overrides import Overrides, current, register
from flash_msa_rt.tuning.problem import Problem
from flash_msa_rt.tuning.sparse_bwd import keys_per_cta, per_group_tiles, small_step

KL_RESIDENT_GROUPS = (1, 2, 4)  # the ping-pong KL pass holds the G + 1 head tiles single-buffered up to G = 4
KL_STREAM_STAGES = 4  # ... and streams them through a ring of this many slots at G = 8, 16
COMBINE_LANE_ELEMENTS = 16  # the combine's widest lane: 2 x 16-byte loads per slot
HOST_BOUND_ROWS = 1 << 16  # proxy rows B Hp S up to which an eager step's host time exceeds its device time
FEW_ITEMS_ROWS = 1 << 16  # proxy rows B Hp S up to which the forward's items hold 16 tiles


@dataclass(frozen=True)
class SparseFwdTuning:
    mma: str  # sparse_fwd's MMA
    schedule: str  # how its two warpgroups share a tile: "pingpong" (wgmma) | "lockstep"
    stages: int  # q tile buffers
    kl_mma: str  # the KL pass's MMA
    kl_schedule: str  # "pingpong" (wgmma) | "lockstep"
    kl_stages: int
    kl_tile_n: int  # keys per CTA of the KL pass
    combine_heads: int  # heads per warp of the combine
    tiles_per_item: int  # forward: tiles of 128 // G queries per work item
    kl_tiles_per_item: int  # KL pass: tiles of 64 queries x G heads per work item
    chunks: str  # a problem past the budget is cut into chunks of "heads" first, or of "queries"
    item_order: str  # chunk_plans' order of the items
    bin_queries: int  # item order "bins": queries per bin (one bin's gathered q rows about 8 MiB)
    partials_budget: int  # bytes of per-slot partials one chunk may hold
    kl_partials_budget: int  # bytes of (A, T, L) partials per chunk of the KL pass alone (warmup)


register("sparse_fwd", SparseFwdTuning)


def choose(arch: str, problem: Problem = Problem()) -> SparseFwdTuning:
    return _choose(arch, problem, current())


@functools.lru_cache(maxsize=256)
def _choose(arch: str, p: Problem, overrides: Overrides) -> SparseFwdTuning:
    o = overrides.fields("sparse_fwd")
    G = p.group
    mma = o.get("mma", default_mma(arch))
    # Ping-pong on wgmma, one 16K-query chunk at S = 64K, lockstep -> ping-pong: (a) 2.79 -> 2.22 ms, (b) 5.36 ->
    # 4.32, (c) 9.68 -> 8.76, bit-identical; mma.sync has the lockstep kernel only.
    schedule = o.get("schedule", "pingpong" if mma == "wgmma" else "lockstep")
    # One q buffer in ping-pong runs two CTAs per SM: 2 -> 1 buffers (b) 64K 3.85 -> 3.40 ms, (c) G = 16 8.25 ->
    # 6.82; at G = 1 one buffer spills (the 128 registers two CTAs allow).
    stages = o.get("stages", forward_stages(p.head_dim, G)) if schedule == "pingpong" else 2
    kl_mma = o.get("kl_mma", default_mma(arch))
    # The KL pass in ping-pong on wgmma: (b) 4.40 -> 2.12 ms on a 16K-query chunk, (c) G = 16 6.70 -> 4.62. At
    # D 256 lockstep, one buffer: each ping-pong warpgroup's G + 1 head tiles need 289792-394240 bytes of shared
    # memory (sm90a: 232448; kernels_src.sparse_kl.smem_bytes).
    kl_schedule = o.get("kl_schedule", "pingpong" if kl_mma == "wgmma" and not wide(p.head_dim) else "lockstep")
    kl_stages = gather_stages(p.head_dim, 2) if kl_schedule != "pingpong" else \
        (1 if G in KL_RESIDENT_GROUPS else KL_STREAM_STAGES)
    return SparseFwdTuning(
        mma=mma, schedule=schedule, stages=stages, kl_mma=kl_mma, kl_schedule=kl_schedule,
        kl_stages=o.get("kl_stages", kl_stages),
        kl_tile_n=o.get("kl_tile_n", keys_per_cta(kl_mma, p.block_size)),
        # As many of the G heads per warp as keep a lane at 16 elements: bitwise the one-head kernel's results.
        combine_heads=o.get("combine_heads", max(1, min(G, 32 * COMBINE_LANE_ELEMENTS // p.head_dim))),
        # 64 tiles against 32 with whole lists, forward (b) / (a) / (c) 64K: 35.47 -> 34.31, 17.91 -> 17.70,
        # 65.62 -> 64.96 ms. Up to 64K proxy rows the plans hold a few hundred items of 64 tiles for 264 CTA slots,
        # and the longest set the launch's end: whole graphed fwd + bwd, (a) B = 1 8K / 16K, 2.259 -> 2.094 /
        # 4.423 -> 4.278 ms at 16 tiles (32: 2.107 / 4.298; sweep_small, H100, c422079).
        tiles_per_item=o.get("tiles_per_item", 16 if 0 < p.proxy_rows <= FEW_ITEMS_ROWS else 64),
        # KL pass at (b) 64K: 12.73 / 12.53 / 12.47 ms at 8 / 16 / 32 tiles per item (128 // G, at most 32). Small
        # steps (small_step): every kernel's items a quarter of their size, (a) B = 1 8K 2.259 -> 2.064 ms against
        # 2.094 with the forward's alone (sweep_small, H100, c422079); at 16K the backward's quarter items lost
        # 1.8 %, so the rest stay whole there.
        kl_tiles_per_item=o.get("kl_tiles_per_item", per_group_tiles(32 if small_step(p) else 128, G)),
        # Chunks of heads keep every reverse list whole, so its items are full (query chunks cut each list in n).
        chunks=o.get("chunks", "heads"),
        # Longest items first against list order: forward (a) / (b) / (c) 64K 18.12 -> 17.30, 32.52 -> 32.23,
        # 61.48 -> 60.31 ms. Up to 64K proxy rows B Hp S the step is host-bound and the order's sort (four torch
        # ops) only adds host time: with the backward taking the forward's sorted lists (tuning.plan), (a) B = 1,
        # S = 8K issues a step in 2.35 ms against 2.88 (exact) on the H200's host, and at 16K, device-bound, the
        # step takes 4.11 ms against 4.09 (host_time.json, cb2af22, interleaved).
        item_order=o.get("item_order", "size" if p.proxy_rows > HOST_BOUND_ROWS else "list"),
        bin_queries=o.get("bin_queries", max(1024, (8 << 20) // (p.group * p.head_dim * 2))),
        # At least 2 GiB (at (a) B = 1, S = 64K: 4 chunks 9.9-10.4 ms, 1 chunk 8.4-8.5), or dq_bytes = 4 B S H D:
        # (b) 64K B = 2 66.9 ms in 18 chunks of 1 GiB, 56.9 in 5 of 4 GiB. The backward adds at least dq_bytes
        # anyway (dq in the input dtype and the upstream dO, 2 B S H D each), so the forward's peak stays under
        # the op's: (b) 1M, forward 48.4 GiB, backward 51.3 (docs/memory.md).
        partials_budget=o.get("partials_budget", max(2 << 30, p.dq_bytes)),
        kl_partials_budget=o.get("kl_partials_budget", 1 << 30),  # warmup's KL pass alone: its partials are small
    )
