"""Tuning policy of packed sequences on the fixed-length kernels (flash_msa_rt.ops.packed): when sequences of
different lengths share one padded call."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.overrides import Overrides, current, register
from flash_msa_rt.tuning.problem import Problem


@dataclass(frozen=True)
class PackedTuning:
    # What one more call of an op costs, in (query, key) pairs of causal attention per head: a bucket of shorter
    # sequences joins the next longer one when padding its members to that length adds at most this many pairs.
    call_pairs: int


register("packed", PackedTuning)


def choose(arch: str, problem: Problem = Problem()) -> PackedTuning:
    return _choose(arch, current())


@functools.lru_cache(maxsize=64)
def _choose(arch: str, overrides: Overrides) -> PackedTuning:
    o = overrides.fields("packed")
    # (b), one 64K document + 141 of 128..1024 tokens in 9 calls per op: 93.1 ms fwd + bwd against ~39.8 for the
    # 64K document alone, ~7 ms of it the short documents' own work, so ~5.8 ms per extra bucket; the fixed batch
    # runs ~4e6 causal pairs per ms (16 x 8K: 2.35e8 pairs per head in 58.4 ms), so a call ~2.3e7 pairs. 2**24 stays
    # below it (benchmarks/results/packed_b.json, f23d22c).
    return PackedTuning(call_pairs=int(o.get("call_pairs", 1 << 24)))
