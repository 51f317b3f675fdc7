"""Tuning policy of select_blocks (the selection kernel: the proxy's block scores and the top-K)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.mma import default_mma
from flash_msa_rt.tuning.overrides import Overrides, current, register
from flash_msa_rt.tuning.problem import Problem


@dataclass(frozen=True)
class SelectTuning:
    mma: str  # the score tiles' MMA: "sync" | "wgmma"
    schedule: str = "block"  # fp8 selection's loop: "block" | "pairs" (two key blocks per step; opt-in build)
    block64_schedule: str = "block"  # the loop at key blocks of 64: "block" | "wide" (two per 128-key step; opt-in)


register("select", SelectTuning)


def choose(arch: str, problem: Problem = Problem()) -> SelectTuning:
    return _choose(arch, current())


@functools.lru_cache(maxsize=64)
def _choose(arch: str, overrides: Overrides) -> SelectTuning:
    o = overrides.fields("select")
    # "block": fp8 selection measured 972-1,038 TFLOP/s with it (benchmarks/results/fp8_select.json, 44e5293);
    # "pairs" has not run on a GPU yet (an opt-in build: kernels_src/select/NOTES.md, "Levers left").
    return SelectTuning(mma=o.get("mma", default_mma(arch)),  # default_mma: select 20.07 -> 15.82 ms on wgmma
                        schedule=o.get("schedule", "block"),
                        # "wide" (blocks of 64 scored as blocks of 128, kernels_src/select/NOTES.md) has not run on
                        # a GPU yet: an opt-in build until it has, and been measured against "block".
                        block64_schedule=o.get("block64_schedule", "block"))
