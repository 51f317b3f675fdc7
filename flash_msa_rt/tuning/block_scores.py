"""Tuning policy of proxy_block_scores (the selection's score stage alone)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.mma import default_mma
from flash_msa_rt.tuning.overrides import Overrides, current, register
from flash_msa_rt.tuning.problem import Problem


@dataclass(frozen=True)
class BlockScoresTuning:
    mma: str  # the score tiles' MMA: "sync" | "wgmma"


register("block_scores", BlockScoresTuning)


def choose(arch: str, problem: Problem = Problem()) -> BlockScoresTuning:
    return _choose(arch, current())


@functools.lru_cache(maxsize=64)
def _choose(arch: str, overrides: Overrides) -> BlockScoresTuning:
    o = overrides.fields("block_scores")
    return BlockScoresTuning(mma=o.get("mma", default_mma(arch)))  # the select kernel's score tiles (~1.25x)
