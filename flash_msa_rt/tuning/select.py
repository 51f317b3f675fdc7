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


register("select", SelectTuning)


def choose(arch: str, problem: Problem = Problem()) -> SelectTuning:
    return _choose(arch, current())


@functools.lru_cache(maxsize=64)
def _choose(arch: str, overrides: Overrides) -> SelectTuning:
    o = overrides.fields("select")
    return SelectTuning(mma=o.get("mma", default_mma(arch)))  # default_mma: select 20.07 -> 15.82 ms on wgmma
