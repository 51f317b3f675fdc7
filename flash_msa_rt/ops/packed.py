"""Packed sequences (cu_seqlens) on the fixed-length kernels: each run of consecutive sequences of one length is one
fixed-length call (B = the run's count) on views of the packed tensors, and the outputs are concatenated along the
tokens.

Every sequence is independent (msa-semantics.md, varlen): its own causal mask, block grid from its start, selection
and KL rows, so running them apart is the contract itself. The cost: reading cu_seqlens on the host (one
synchronisation per op call, which the varlen entry points' validation already makes) and one set of launches per
run of equal lengths, so a pack of many short documents of different lengths is host-bound. Kernels that take the offsets themselves
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


def equal_runs(spans: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(start, length, count): consecutive sequences of one length, which are a fixed-length batch of `count` rows
    on views of the pack (16 x 8K as 16 calls of B = 1 measured 1.13-1.40x the batch's time on the H200, (a)-(c),
    benchmarks/results/packed.json; as one call they are the batch)."""
    runs: list[list[int]] = []
    for a, b in spans:
        if runs and runs[-1][0] + runs[-1][1] * runs[-1][2] == a and runs[-1][1] == b - a:
            runs[-1][2] += 1
        else:
            runs.append([a, b - a, 1])
    return [tuple(r) for r in runs]


def _rows(t: torch.Tensor, dim: int, a: int, length: int, count: int) -> torch.Tensor:
    """The count x length tokens from a along `dim` (1 or 2) of a B = 1 tensor as a batch of `count` rows."""
    x = t.narrow(dim, a, length * count)
    if count == 1:
        return x
    if dim == 1:
        return x.reshape(count, length, *x.shape[2:])
    return x.reshape(x.shape[1], count, length, *x.shape[3:]).transpose(0, 1).contiguous()


def _unrows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """_rows' inverse on a result: (count, ...) rows back to one B = 1 stretch of tokens along `dim`."""
    if t.shape[0] == 1:
        return t
    if dim == 1:
        return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])
    return t.transpose(0, 1).reshape(1, t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])


def per_sequence(op: str, impl: Callable, fallback: Callable) -> Callable:
    """impl (fixed length) made to take the op's cu_seqlens: without it impl runs as is; with it, once per run of
    consecutive equal-length sequences (a batch on views of the pack), the results concatenated. A pack without
    tokens runs `fallback` (the reference: nothing to launch)."""
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
        for a, length, count in equal_runs(spans):
            piece = list(args)
            for i, dim in spec.tokens.items():
                if piece[i] is not None:
                    piece[i] = _rows(piece[i], dim, a, length, count)
            for i in spec.per_row:
                t = piece[i]
                if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[2] == total and total > 1:
                    piece[i] = _rows(t, 2, a, length, count)
            result = impl(*piece, **kwargs)
            if isinstance(result, (tuple, list)):
                parts.append(tuple(_unrows(r, dim) for r, dim in zip(result, spec.outs)))
            else:
                parts.append(_unrows(result, spec.outs[0]))
        if len(parts) == 1:  # one run covers the pack: its results are the pack's (no copy)
            return parts[0]
        if not isinstance(parts[0], tuple):
            return torch.cat(parts, dim=spec.outs[0])
        return tuple(torch.cat([p[n] for p in parts], dim=dim) for n, dim in enumerate(spec.outs))

    return run
