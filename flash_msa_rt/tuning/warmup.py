"""Tuning policy of warmup mode (flash_msa_rt.ops.kernels: _warmup_forward / _warmup_backward): where its main
attention and its proxy passes run."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.overrides import Overrides, current, register
from flash_msa_rt.tuning.problem import Problem

KL_SCHEDULE_THREADS = {"lockstep": 256, "pingpong": 288}  # the dense KL pass's threads per schedule
BACKWARD_CHUNK = 4  # the dense proxy backward's widest variant: G = 8, 16 run as G / 4 launches of it


@dataclass(frozen=True)
class WarmupTuning:
    dense_main: bool  # the main attention on cuDNN where usable (else the sparse kernels, every causal block)
    dense_proxy: bool  # the KL pass and proxy backward on the dense warmup kernels where built (else sparse)
    kl_schedule: str  # the dense KL pass: "pingpong" (a producer warp, warpgroups taking turns) | "lockstep"
    backward_chunk: int  # heads per launch of the dense proxy backward


register("warmup", WarmupTuning)


def choose(arch: str, problem: Problem = Problem()) -> WarmupTuning:
    return _choose(arch, current())


@functools.lru_cache(maxsize=64)
def _choose(arch: str, overrides: Overrides) -> WarmupTuning:
    o = overrides.fields("warmup")
    return WarmupTuning(
        # cuDNN runs dense causal attention at ~600 TFLOP/s on the H200; the sparse kernels over every causal
        # block are about 2x slower.
        dense_main=o.get("dense_main", True),
        # The dense kernels walk the causal prefix with no plan, no gathered rows and no per-slot partials.
        dense_proxy=o.get("dense_proxy", True),
        kl_schedule=o.get("kl_schedule", "pingpong"),
        backward_chunk=o.get("backward_chunk", BACKWARD_CHUNK),
    )
