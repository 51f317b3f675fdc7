"""Packed sequences (cu_seqlens) on the fixed-length kernels: each sequence of the pack is one B = 1 call on views of
the packed tensors, and the outputs are concatenated along the tokens.

Every sequence is independent (msa-semantics.md, varlen): its own causal mask, block grid from its start, selection
and KL rows, so running them one by one is the contract itself. The cost: reading cu_seqlens on the host (one
synchronisation per op call, which the varlen entry points' validation already makes) and one set of launches per
non-empty sequence, so a pack of many short documents is host-bound. Kernels that take the offsets themselves
(issue 34) replace this. Separate key offsets (cu_seqlens_k, seqused_k) are declined before this runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class PackedOp:
    """Where an op's arguments and results carry the token dimension: `cu` the position of cu_seqlens among the
    positional arguments, `tokens` {argument position: its token dim}, `per_row` the argument positions that are
    per (b, p, i) row only when full-sized (kl_grad: else a broadcast scalar), `outs` each result's token dim."""

    cu: int
    tokens: dict
    outs: tuple
    per_row: tuple = ()


SPECS = {
    "select_blocks": PackedOp(5, {0: 1, 1: 1}, (2,)),
    "msa_forward": PackedOp(8, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2}, (1, 2, 2, 2)),
    "msa_backward": PackedOp(13, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 2, 7: 2, 8: 2, 11: 1}, (1,) * 5, (12,)),
    "msa_kl": PackedOp(9, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2}, (2, 2)),
    "warmup_forward": PackedOp(6, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}, (1, 2, 2, 2)),
    "warmup_backward": PackedOp(11, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 2, 7: 2, 9: 1}, (1,) * 5, (10,)),
    "warmup_kl": PackedOp(7, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2}, (2, 2)),
    "block_sparse_forward": PackedOp(6, {0: 1, 1: 1, 2: 1, 3: 2}, (1, 2)),
    "block_sparse_backward": PackedOp(9, {0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 8: 1}, (1, 1, 1)),
}


def sequence_spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of every non-empty sequence (a host read of the offsets)."""
    bounds = cu_seqlens.tolist()
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def per_sequence(op: str, impl: Callable, fallback: Callable) -> Callable:
    """impl (fixed length) made to take the op's cu_seqlens: without it impl runs as is; with it, once per
    non-empty sequence on views, the results concatenated. A pack without tokens runs `fallback` (the reference:
    nothing to launch)."""
    spec = SPECS[op]

    def run(*args, **kwargs):
        args = list(args)
        cu = args[spec.cu] if len(args) > spec.cu else kwargs.pop("cu_seqlens", None)
        if len(args) > spec.cu:
            args[spec.cu] = None
        if cu is None:
            return impl(*args, **kwargs)
        total = args[0].shape[1]
        spans = sequence_spans(cu)
        if not spans:
            args[spec.cu] = cu
            return fallback(*args, **kwargs)
        parts = []
        for a, b in spans:
            piece = list(args)
            for i, dim in spec.tokens.items():
                if piece[i] is not None:
                    piece[i] = piece[i].narrow(dim, a, b - a)
            for i in spec.per_row:
                t = piece[i]
                if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[2] == total and total > 1:
                    piece[i] = t.narrow(2, a, b - a)
            parts.append(impl(*piece, **kwargs))
        single = not isinstance(parts[0], (tuple, list))
        if single:
            return torch.cat(parts, dim=spec.outs[0])
        return tuple(torch.cat([p[n] for p in parts], dim=dim) for n, dim in enumerate(spec.outs))

    return run
