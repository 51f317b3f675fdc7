"""Tuning policy of kl_value "deferred" and "none" on sparse MSA (flash_msa_rt.api): where the KL pass runs when
kl_loss's value may wait for the backward (or is not wanted). The contract holds either way (kl_loss's forward value
0, kl_metric written by the backward, the same gradients): this only moves device work between the passes."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.overrides import Overrides, current, register


@dataclass(frozen=True)
class KlValueTuning:
    # The forward runs its KL pass (fused with the forward's plan, as "exact") up to this many proxy rows B * Hp * S
    # of a fixed-length call on these device types; above (or elsewhere), the backward runs it.
    forward_pass_rows: int
    forward_pass_devices: tuple[str, ...]


register("kl_value", KlValueTuning)


def choose(overrides: Overrides | None = None) -> KlValueTuning:
    return _choose(current() if overrides is None else overrides)


@functools.lru_cache(maxsize=64)
def _choose(overrides: Overrides) -> KlValueTuning:
    o = overrides.fields("kl_value")
    return KlValueTuning(
        # Small steps are host-bound, and the backward's own KL pass plans the selection again (~23 torch ops and
        # 3 launches more): (a) B = 1 on the H200, deferred forward + backward 2.94 / 4.04 ms against exact's 2.19 /
        # 3.95 at 8K / 16K (32K / 64K proxy rows), 8.31 / 8.25 at 32K, 19.23 / 19.60 at 64K (a run at d852150;
        # benchmarks/results/msa_batch1.json, c06d598, has the figures with this policy: 3.12 against 2.70 at 8K,
        # 3.98 / 3.95 at 16K; from 32K the backward route, now the proxy lse alone: 7.71 against 8.49).
        # Above ~64K rows the device work is the same either way and the forward stays light.
        forward_pass_rows=o.get("forward_pass_rows", 1 << 16),
        # Where host time is the bound: the CUDA kernels. On the CPU reference the route changes nothing but
        # which code path the tests exercise (they pick it with an override).
        forward_pass_devices=tuple(o.get("forward_pass_devices", ("cuda",))),
    )
