"""One call's options, validated once by flash_msa_rt.api and carried through the layers as one frozen object.

Why: a call's knobs (selection size, scales, offsets, KL mode, sinks, ...) would otherwise travel as a dozen
positional values through api._msa, api._run, the eager Function and the op calls, and every new option would
lengthen each signature. The custom ops (flash_msa_rt.ops.library) still take flat arguments: their schemas are
the public torch.library contract.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class MsaOptions:
    """Validated options of one MSA call (flash_msa_func, the warmup and varlen forms, context parallelism).

    sparse: MSA (selection + sparse attention) or warmup (dense causal). K: selected blocks per query.
    scale: the main softmax scale; proxy_scale: the proxy scores' (None: scale, today's behaviour bit for bit).
    local_blocks: the L most recent blocks always selected. sinks: float32 (H,) sink logits or None; it is also
    an input of the autograd graph (its gradient flows), passed alongside, never read from here by autograd.
    max_seqlen: the packs' bound where the offsets are planned on the device under torch.compile (the custom ops'
    argument; None otherwise). kl: whether the forward runs the KL pass; value_now: whether kl_loss (and
    kl_metric) hold the value after the forward (flash_msa_rt.api._kl_route decides both).
    """

    sparse: bool
    K: int
    block_size: int
    scale: float
    proxy_scale: float | None = None
    local_blocks: int = 1
    sinks: torch.Tensor | None = None
    select_precision: str = "bf16"
    kl_value: str = "exact"
    kl_metric: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    max_seqlen: int | None = None
    kl: bool = True
    value_now: bool = True

    def replace(self, **changes) -> "MsaOptions":
        return dataclasses.replace(self, **changes)

    @property
    def selection_scale(self) -> float:
        """The scale the selection scores with: the proxy's (the ranking does not depend on it)."""
        return self.scale if self.proxy_scale is None else self.proxy_scale
