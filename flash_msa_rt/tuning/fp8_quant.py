"""Tuning policy of fp8 selection's quantisation pass (flash_msa_rt.ops.select, select_precision="fp8")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.overrides import Overrides, current, register
from flash_msa_rt.tuning.problem import Problem


@dataclass(frozen=True)
class Fp8QuantTuning:
    quantize: str  # "kernel": the fp8_quant kernels (flash_msa_rt.ops.fp8_quant); "torch": reference.fp8's ops


register("fp8_quant", Fp8QuantTuning)


def choose(arch: str, problem: Problem = Problem()) -> Fp8QuantTuning:
    return _choose(arch, current())


@functools.lru_cache(maxsize=64)
def _choose(arch: str, overrides: Overrides) -> Fp8QuantTuning:
    o = overrides.fields("fp8_quant")
    # kernel on sm90a: 0.146 ms against torch's 1.126 ms at (b) S = 128K, B = 1 (3.1 vs 0.41 TB/s, floor 0.114 ms),
    # byte-equal; 1.5% / 0.8% / 0.4% / 0.1% of fp8 selection at 64K B = 2 / 128K / 256K / 1M
    # (benchmarks/results/fp8_quant.json, f23d22c). fp8 selection runs on sm90a only (its select variants are
    # wgmma's): elsewhere the torch ops stay, and the kernels are opt-in builds.
    return Fp8QuantTuning(quantize=o.get("quantize", "kernel" if arch == "sm90a" else "torch"))
