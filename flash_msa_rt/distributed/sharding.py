"""Which tokens of a sequence each rank holds, and the collectives that move whole sequences.

"zigzag" cuts the sequence into 2N chunks and gives rank r chunks r and 2N-1-r (Megatron-LM's causal load balance:
every rank then holds the same number of (query, causal key) pairs, up to rounding); "contiguous" gives rank r chunk
r of N. Chunk i of n is tokens [i S // n, (i + 1) S // n): S need not be a multiple of n (chunks differ by at most
one token; with S < n some are empty). A rank's shard is its chunks concatenated in that order. A pack of
sequences (cu_seqlens over the full stream) is split sequence by sequence, the shard holding the rank's chunks of
each sequence in sequence order (Megatron-LM's THD format).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SCHEMES = ("zigzag", "contiguous")


def check_scheme(fn: str, scheme) -> str:
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(f"{fn}: scheme={scheme!r} is not supported; expected one of {', '.join(SCHEMES)}")
    return scheme


def shard_spans(seqlen: int, world: int, rank: int, scheme: str = "zigzag") -> list[tuple[int, int]]:
    """The [start, end) token ranges of rank `rank`'s shard, in shard order."""
    check_scheme("shard_spans", scheme)
    n = 2 * world if scheme == "zigzag" else world
    bound = [i * seqlen // n for i in range(n + 1)]
    chunks = (rank, n - 1 - rank) if scheme == "zigzag" else (rank,)
    return [(bound[c], bound[c + 1]) for c in chunks]


def pack_spans(bounds: list[int], world: int, rank: int, scheme: str = "zigzag") -> list[tuple[int, int]]:
    """shard_spans of every sequence of a pack (bounds: its offsets, cu_seqlens' values), placed in the pack: the
    rank's chunks of each sequence, sequence after sequence (Megatron-LM's THD split: each sequence balanced on its
    own)."""
    return [(s0 + a, s0 + b) for s0, s1 in zip(bounds[:-1], bounds[1:])
            for a, b in shard_spans(s1 - s0, world, rank, scheme)]


def pack_starts(bounds: list[int], scheme: str = "zigzag") -> list[int]:
    """The start of the sequence each of pack_spans' spans lies in (every rank has as many spans per sequence)."""
    per_sequence = 2 if scheme == "zigzag" else 1
    return [s0 for s0 in bounds[:-1] for _ in range(per_sequence)]


def pack_bounds(fn: str, cu_seqlens, total: int) -> list[int]:
    """cu_seqlens' values (int32 (num_seqs + 1,), from 0 to total, non-decreasing; on the host or any device: read
    on the host, a synchronisation for a device tensor), checked."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.shape[0] < 2:
        shown = (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
                 else type(cu_seqlens).__name__)
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D int32 tensor of num_seqs + 1 >= 2 offsets, got {shown}")
    bounds = [int(v) for v in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"{fn}: cu_seqlens must run from 0 to the {total} tokens of the full pack without "
                         f"decreasing, got {bounds if len(bounds) <= 12 else bounds[:10] + ['...', bounds[-1]]}")
    return bounds


def spans_of(S: int, world: int, rank: int, scheme: str, bounds: list[int] | None) -> list[tuple[int, int]]:
    """A rank's spans of a sequence of S tokens, or of a pack (bounds)."""
    return shard_spans(S, world, rank, scheme) if bounds is None else pack_spans(bounds, world, rank, scheme)


def group_of(fn: str, group):
    """(group, world size, this rank's index in it); a clear error where torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialised; call torch.distributed.init_process_group "
                           f"first (NCCL on GPUs, gloo on CPU) or pass group=")
    return group, dist.get_world_size(group), dist.get_rank(group)


def shard_sequence(x: torch.Tensor, group=None, *, seq_dim: int, scheme: str = "zigzag",
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's shard of the full tensor x (every rank passes the same x): its chunks along seq_dim, concatenated
    (a copy). cu_seqlens: x holds a pack of sequences along seq_dim (offsets over it); each sequence is split on
    its own and the shard holds the rank's chunks of every sequence, in sequence order."""
    fn = "shard_sequence"
    check_scheme(fn, scheme)
    _, world, rank = group_of(fn, group)
    bounds = None if cu_seqlens is None else pack_bounds(fn, cu_seqlens, x.shape[seq_dim])
    spans = spans_of(x.shape[seq_dim], world, rank, scheme, bounds)
    return torch.cat([x.narrow(seq_dim, a, b - a) for a, b in spans], dim=seq_dim)


def seqlen_of(fn: str, local_len: int, group, world: int, seqlen: int | None) -> int:
    """The full sequence length: `seqlen` where the caller gives it (no communication), else the sum of every rank's
    shard length, all-gathered (a host synchronisation)."""
    if seqlen is not None:
        if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 0:
            raise ValueError(f"{fn}: seqlen must be a non-negative int or None, got {seqlen!r}")
        return seqlen
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([local_len], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return int(sum(int(t.item()) for t in every))


class _GatherSequence(torch.autograd.Function):
    """(B, L_r, ...) shards -> the (B, S, ...) sequence in natural order on every rank. Backward: each rank's rows of
    the full gradient summed over the ranks (reduce-scatter; all-reduce where the backend has none) back to their
    owner. Shards are padded to the longest for the collectives."""

    @staticmethod
    def forward(ctx, x, group, spans_of_rank, seqlen):
        world, rank = len(spans_of_rank), dist.get_rank(group)
        lengths = [sum(b - a for a, b in spans) for spans in spans_of_rank]
        longest = max(lengths)
        padded = x.new_zeros((x.shape[0], longest, *x.shape[2:]))
        padded[:, :x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        full = x.new_empty((x.shape[0], seqlen, *x.shape[2:]))
        for part, spans in zip(parts, spans_of_rank):
            at = 0
            for a, b in spans:
                full[:, a:b] = part[:, at:at + b - a]
                at += b - a
        ctx.group, ctx.spans_of_rank, ctx.rank, ctx.longest, ctx.local_len = group, spans_of_rank, rank, longest, \
            x.shape[1]
        return full

    @staticmethod
    def backward(ctx, grad_full):
        grad_full = grad_full.contiguous()
        B, rest = grad_full.shape[0], grad_full.shape[2:]
        parts = []
        for spans in ctx.spans_of_rank:
            part = grad_full.new_zeros((B, ctx.longest, *rest))
            at = 0
            for a, b in spans:
                part[:, at:at + b - a] = grad_full[:, a:b]
                at += b - a
            parts.append(part)
        if dist.get_backend(ctx.group) == "nccl":
            mine = torch.empty_like(parts[0])
            dist.reduce_scatter(mine, parts, group=ctx.group)
        else:  # gloo has no reduce-scatter
            stacked = torch.stack(parts)
            dist.all_reduce(stacked, group=ctx.group)
            mine = stacked[ctx.rank]
        return mine[:, :ctx.local_len], None, None, None


def gather_sequence(x: torch.Tensor, group, spans_of_rank: list[list[tuple[int, int]]], seqlen: int) -> torch.Tensor:
    """The (B, S, ...) sequence from every rank's (B, L_r, ...) shard (dim 1), differentiable."""
    return _GatherSequence.apply(x, group, spans_of_rank, seqlen)


def unshard_sequence(x_local: torch.Tensor, group=None, *, seq_dim: int, scheme: str = "zigzag",
                     seqlen: int | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor on every rank from each rank's shard along seq_dim (differentiable: the gradient of a rank's
    shard is the sum over ranks of the full tensor's gradient at its rows). seqlen: the full length where known
    (else the shard lengths are all-gathered, a host synchronisation). cu_seqlens: the full pack's offsets, as
    shard_sequence took them (the full length is then their last)."""
    fn = "unshard_sequence"
    check_scheme(fn, scheme)
    _, world, rank = group_of(fn, group)
    dim = seq_dim % x_local.dim()
    if cu_seqlens is not None:
        total = int(cu_seqlens[-1]) if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.numel() else 0
        bounds = pack_bounds(fn, cu_seqlens, seqlen if seqlen is not None else total)
        S = bounds[-1]
    else:
        bounds, S = None, seqlen_of(fn, x_local.shape[dim], group, world, seqlen)
    spans = [spans_of(S, world, r, scheme, bounds) for r in range(world)]
    mine = sum(b - a for a, b in spans[rank])
    if x_local.shape[dim] != mine:
        raise ValueError(f"{fn}: this rank's shard has {x_local.shape[dim]} tokens along dim {seq_dim}, but a "
                         f"{scheme} split of seqlen {S} over {world} ranks gives rank {rank} {mine}")
    moved = x_local.movedim(dim, 1) if x_local.dim() > 1 else x_local.view(1, -1)
    full = gather_sequence(moved, group, spans, S)
    return full.movedim(1, dim) if x_local.dim() > 1 else full.view(-1)
