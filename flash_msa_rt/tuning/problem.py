"""What a tuning policy sees of a call: its sizes (a policy reads the ones its choice depends on)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    group: int = 1  # G = H / Hp: main heads per proxy (or index) head
    head_dim: int = 128  # D (= Dp for the sparse kernels)
    block_size: int = 128
    batch: int = 0  # B; 0 where the choice is asked for the variants alone (no sizes yet)
    seqlen: int = 0  # S
    heads: int = 0  # H

    @property
    def proxy_rows(self) -> int:
        """B Hp S: the rows of the proxy's selection, which the work plans' item counts scale with (0 without
        sizes)."""
        return self.batch * self.seqlen * (self.heads // self.group)

    @property
    def dq_bytes(self) -> int:
        """4 B S H D: the bytes of an fp32 dq over every head, the scale the budgets are measured against (the
        backward itself now holds fp32 accumulators for one run of proxy heads at a time: docs/memory.md)."""
        return 4 * self.batch * self.seqlen * self.heads * self.head_dim
