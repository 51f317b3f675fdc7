"""Tuning policy of the sparse work plans (flash_msa_rt.ops.sparse_plan.chunk_plans)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.overrides import Overrides, current, register
from flash_msa_rt.tuning.problem import Problem


@dataclass(frozen=True)
class PlanTuning:
    lists_on_device: bool  # sort with the plan_lists kernels on CUDA tensors (CPU tensors take the torch sort)
    list_block_sizes: tuple[int, ...]  # the (kernel) block sizes whose plans sort with them
    scatter_threads: int  # rows per scatter CTA at max_k 16 (128 or 512)
    max_cells: int  # past this many (key, tile) count cells the batched torch sort takes less memory
    batch_entries: int  # entries one torch sort may hold (its temporaries take ~16 bytes each)
    query_bin: int  # item order "query": queries per bin
    tile_rows: int  # query rows per plan_lists CTA (its count matrices' columns); the build makes 128
    keep_lists_entries: int  # a selection of at most this many entries keeps its sorted lists for its backward


register("plan", PlanTuning)


def choose(arch: str, problem: Problem = Problem()) -> PlanTuning:
    return _choose(arch, current())


@functools.lru_cache(maxsize=64)
def _choose(arch: str, overrides: Overrides) -> PlanTuning:
    o = overrides.fields("plan")
    return PlanTuning(
        # ~8 torch ops per plan instead of ~35 at ~15 us each of host time: (a) S = 64K, B = 2 enqueued its plans
        # and launches in 4.3-5.4 ms instead of 11-13.
        lists_on_device=o.get("lists_on_device", True),
        # Blocks of 64 too (Bs 64, and D 256's 64-key halves): their plans equal the torch sort's field for field
        # on the H100 (tests/test_sparse_plan_gpu.py, 135 passed at 5ebc287), and at blocks of 128 the kernels
        # took 0.36 ms per (b) 64K plan against ~1.2-1.4 for the sort (kernels_src/plan_lists/NOTES.md).
        list_block_sizes=tuple(o.get("list_block_sizes", (64, 128))),
        scatter_threads=o.get("scatter_threads", 512),  # 512 rows give each list ~4x longer runs of stores
        # Past 2^27 cells (8 bytes each: the counts and their cumsum, 1 GiB) the batched torch sort's temporaries
        # (batch_entries, ~16 bytes each) take less memory. Per head group (chunk_plans sorts one group at a time
        # where all of them would pass): (b) S = 1M, B = 1 sorts one head's 67M cells at a time, and its fwd + bwd
        # step (deferred, fp8) kept the device busy 1,626.0 ms against 1,633.1 with the torch sort (traced, one
        # process, 8359756); its wall time moved within run-to-run noise (0.997-0.999x, benchmarks/ab_tuning.py).
        max_cells=o.get("max_cells", 1 << 27),
        batch_entries=o.get("batch_entries", 1 << 26),
        query_bin=o.get("query_bin", 2048),  # the backward's query bins (sparse_bwd's item order)
        tile_rows=o.get("tile_rows", 128),  # tests: emulated plan kernels on smaller tiles
        # The backward plans the forward's selection again: a sort of two launches and ~5 torch ops. Kept, with
        # the forward's list order at host-bound sizes (tuning.sparse_fwd), an eager step at (a) B = 1, S = 8K
        # issues in 2.35 ms against 2.88 (exact) and 2.55 against 2.90 (deferred) on the H200's host, timed
        # interleaved (benchmarks/results/host_time.json, cb2af22). Up to 4M entries (32 MiB of lists held from
        # the forward to the backward): B Hp S K of 64K proxy rows at K = 64, past the host-bound sizes.
        keep_lists_entries=o.get("keep_lists_entries", 1 << 22),
    )
