"""Tuning policies: per op, one function of (arch, problem) that returns a frozen choice of variants, chunking and
work items, each field with the measurement behind it.

    flash_msa_rt.tuning.sparse_fwd.choose("sm90a", Problem(group=4, batch=2, seqlen=65536, heads=32))

Layout: one module per op (select, fp8_quant, block_scores, sparse_fwd, sparse_bwd, warmup, plan, packed) and
kl_value (where deferred mode's KL pass runs); mma says
which MMA each family runs per arch; overrides holds the one way to run something else (tests, benchmarks):

    with flash_msa_rt.tuning.override(sparse_bwd={"producer": False}):
        ...
"""

from __future__ import annotations

from flash_msa_rt.tuning import (block_scores, fp8_quant, kl_value, packed, plan, select, sparse_bwd, sparse_fwd,
                                 warmup)
from flash_msa_rt.tuning.mma import default_mma, every_mma
from flash_msa_rt.tuning.overrides import NONE, Overrides, applied, current, override
from flash_msa_rt.tuning.problem import Problem

__all__ = ["NONE", "Overrides", "Problem", "applied", "block_scores", "current", "default_mma", "every_mma",
           "fp8_quant", "kl_value", "override", "packed", "plan", "select", "sparse_bwd", "sparse_fwd", "warmup"]
