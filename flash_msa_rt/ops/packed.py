"""Packed sequences (cu_seqlens) on the fixed-length kernels: each run of consecutive sequences of one length is one
fixed-length call (B = the run's count) on views of the packed tensors, and the outputs are concatenated along the
tokens. For the sparse ops (selection, MSA, block-sparse), sequences of different lengths that round up to the
same number of 128-token blocks also share one call: each is copied into a row of that padded length, zeros after
its end (block indices -1), and only its own rows of the results are kept; short buckets join longer ones while
that costs less than a call (tuning.packed).

Every sequence is independent (msa-semantics.md, varlen): its own causal mask, block grid from its start, selection
and KL rows, so running them apart is the contract itself. Padding keeps it: a sequence's queries never see the
keys after its end (causal), its last block is its own local block whatever the padding holds (so no score of a
padded key is ever compared, in fp8 selection neither: zeros change no block's max |x|), and in the backward the
padded rows have no selected block, a zero upstream gradient and a zero KL gradient, so they add nothing to any
key (warmup's lse is padded with +inf, so a padded row's dense probabilities are 0).

Three ways in:
  - eager: the offsets read on the host once per tensor and version (flash_msa_rt.ops.offsets, shared with the
    varlen validation), runs and buckets as above; warmup keeps runs only (bucketing its dense attention is not
    measured);
  - under CUDA graph capture: no host read; the whole pack is one batch padded to the caller's max_seqlen, planned
    on the device (_DevicePadded);
  - separate key offsets (cu_seqlens_k, seqused_k; tuning.packed): each query sequence against a view of its keys,
    unpadded where the op's kernels take longer keys (keys_longer), else front-padded to its key length
    (_separate_keys).
A backward asked for the deferred KL value (kl_metric) gives each call a sink for its KL rows instead and writes
one mean over the pack's real rows (PackKL), so a pack keeps the fused KL value of the proxy backward.
Kernels that take the offsets themselves would replace all three.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.ops.offsets import capturing, declared_max_seqlen, host_offsets, host_view, plan_bound
from flash_msa_rt.ops.packed_kl import PackKL
from flash_msa_rt.tuning import packed as tuning_packed


@dataclass(frozen=True)
class PackedOp:
    """Where an op's arguments and results carry the token dimension: `cu` the position of cu_seqlens among the
    positional arguments, `tokens` {argument position: its token dim}, `per_row` the argument positions that are
    per (b, p, i) row only when full-sized (kl_grad: else a broadcast scalar), `outs` each result's token dim."""

    cu: int
    tokens: dict
    outs: tuple
    per_row: tuple = ()
    paddable: bool = False  # sequences of different lengths may share a padded call (the module's docstring)
    # lse arguments, padded with +inf rather than 0: a padded row's probabilities are then exactly 0, so a dense
    # backward (warmup's cuDNN one) adds nothing from it to any key (with lse 0, exp(s) could overflow and
    # inf * 0 = NaN would reach the real keys' gradients).
    inf_pad: tuple = ()
    keys: tuple = (1, 3, 4)  # the arguments on the keys' tokens (k_proxy, k, v) where keys have offsets of their own
    key_outs: tuple = ()  # the results on the keys' tokens (the backward's dk_proxy, dk, dv)
    # the fixed-length op takes keys longer than its queries itself (the queries being the last of the key
    # positions): separate key offsets then need no query padding (the select and sparse MSA kernels' query
    # offset, Sk - S from the shapes)
    keys_longer: bool = False


SPECS = {
    "select_blocks": PackedOp(5, {0: 1, 1: 1}, (2,), paddable=True, keys=(1,), keys_longer=True),
    "msa_forward": PackedOp(8, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2}, (1, 2, 2, 2), paddable=True, keys_longer=True),
    "msa_backward": PackedOp(13, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 2, 7: 2, 8: 2, 11: 1}, (1,) * 5, (12,),
                             paddable=True, key_outs=(1, 3, 4), keys_longer=True),
    "msa_kl": PackedOp(9, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2}, (2, 2), paddable=True, keys_longer=True),
    "warmup_forward": PackedOp(6, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}, (1, 2, 2, 2)),
    "warmup_backward": PackedOp(11, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 2, 7: 2, 9: 1}, (1,) * 5, (10,),
                                inf_pad=(6, 7), key_outs=(1, 3, 4)),
    "warmup_kl": PackedOp(7, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2}, (2, 2), inf_pad=(5,)),
    "block_sparse_forward": PackedOp(6, {0: 1, 1: 1, 2: 1, 3: 2}, (1, 2), paddable=True),
    "block_sparse_backward": PackedOp(9, {0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 8: 1}, (1, 1, 1), paddable=True),
}

# Padded lengths are multiples of the kernels' 128-row query tiles, whose cost does not depend on how many of their
# rows are real; not yet measured on a GPU (benchmarks/bench_packed.py's "short" case will).
PAD_UNIT = 128


def padded_length(length: int) -> int:
    """The row length a sequence takes in a padded bucket: its length rounded up to PAD_UNIT, so the padding costs
    no query tile (a sequence's last tile is partial either way) and less than one key block."""
    return -(-length // PAD_UNIT) * PAD_UNIT


@dataclass(frozen=True)
class Batch:
    """One fixed-length call: `count` consecutive sequences of `length` tokens from `start` (views of the pack), or,
    where `members` is given, those (start, end) sequences padded to `length` (copies)."""

    start: int
    length: int
    count: int
    members: tuple = ()


def batches(spans: list[tuple[int, int]], paddable: bool, call_pairs: int = 0,
            merge_max_length: int = 0) -> list[Batch]:
    """The calls a pack takes: its runs of equal lengths (equal_runs); for a paddable op, the runs whose lengths
    round up to one padded_length together as one padded batch wherever there are several such runs, and a bucket
    joins the next longer one, up to merge_max_length, where padding its sequences to that length adds at most
    call_pairs causal (query, key) pairs per head (tuning.packed: what one more call costs)."""
    runs = [Batch(a, length, count) for a, length, count in equal_runs(spans)]
    if not paddable:
        return runs
    buckets: dict[int, list[Batch]] = {}
    for r in runs:
        buckets.setdefault(padded_length(r.length), []).append(r)
    groups: list[list] = []  # [padded length, its runs], shortest first
    for length in sorted(buckets):
        if groups and length <= merge_max_length:
            shorter = sum(r.count for r in groups[-1][1])
            if shorter * (length * length - groups[-1][0] ** 2) // 2 <= call_pairs:
                groups[-1] = [length, groups[-1][1] + buckets[length]]
                continue
        groups.append([length, buckets[length]])
    out = []
    for length, group in groups:
        if len(group) == 1:
            out.extend(group)
        else:
            members = tuple((r.start + n * r.length, r.start + (n + 1) * r.length)
                            for r in group for n in range(r.count))
            out.append(Batch(min(a for a, _ in members), length, len(members), tuple(sorted(members))))
    return sorted(out, key=lambda b: b.start)


def sequence_spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of every non-empty sequence (a host read of the offsets, once per offsets tensor: offsets.py)."""
    return list(host_view(cu_seqlens).spans)


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


class _Padded:
    """A padded batch's copies: its members' tokens gathered into rows of batch.length (zeros after each end, -1 in
    integer tensors: no selected block), and its results' real rows put back at their places in the pack."""

    def __init__(self, batch: Batch, device: torch.device):
        starts = torch.tensor([a for a, _ in batch.members])
        lengths = torch.tensor([b - a for a, b in batch.members])
        pos = torch.arange(batch.length)
        valid = pos[None, :] < lengths[:, None]  # (count, length)
        index = torch.where(valid, starts[:, None] + pos[None, :], 0).flatten()  # padding reads token 0, then masked
        self.count, self.length = batch.count, batch.length
        self.valid = valid.to(device)
        self.index = index.to(device)
        self.keep = valid.flatten().nonzero().squeeze(1).to(device)  # real rows among the padded ones
        self.dest = index[valid.flatten()].to(device)  # their tokens in the pack

    def rows(self, t: torch.Tensor, dim: int, fill: float | None = None) -> torch.Tensor:
        """(count, length, ...) for dim 1, (count, heads, length, ...) for dim 2, from a B = 1 packed tensor; the
        padding holds `fill`, by default 0 (-1 in integer tensors)."""
        if dim == 1:
            x = t[0].index_select(0, self.index).view(self.count, self.length, *t.shape[2:])
            mask = self.valid.view(self.count, self.length, *([1] * (t.dim() - 2)))
        else:
            x = t[0].index_select(1, self.index).view(t.shape[1], self.count, self.length, *t.shape[3:])
            x = x.transpose(0, 1)
            mask = self.valid.view(self.count, 1, self.length, *([1] * (t.dim() - 3)))
        if fill is None:
            fill = 0 if t.is_floating_point() else -1
        return torch.where(mask, x, torch.full((), fill, dtype=t.dtype, device=t.device)).contiguous()

    def put(self, full: torch.Tensor, r: torch.Tensor, dim: int) -> None:
        """The real rows of a result r (rows' layout) into their tokens of the B = 1 tensor full."""
        if dim == 1:
            full[0].index_copy_(0, self.dest, r.reshape(self.count * self.length, *r.shape[2:])[self.keep])
        else:
            flat = r.transpose(0, 1).reshape(r.shape[1], self.count * self.length, *r.shape[3:])
            full[0].index_copy_(1, self.dest, flat.index_select(1, self.keep))


_TAKES: dict[int, tuple] = {}  # id(cu_seqlens) -> (weakref to it, its version, {(batch, device): _Padded})


def _padded(cu: torch.Tensor, batch: Batch, device: torch.device) -> _Padded:
    """batch's gather and scatter indices, made once per offsets tensor and version: every op of a step (selection,
    forward, KL pass, backward, in every layer that gets the same offsets) reuses them instead of building them
    on the host and copying them to the device again."""
    key, version = id(cu), getattr(cu, "_version", None)
    kept = _TAKES.get(key)
    if kept is None or kept[0]() is not cu or kept[1] != version:
        kept = (weakref.ref(cu, lambda _, key=key: _TAKES.pop(key, None)), version, {})
        if version is not None:
            _TAKES[key] = kept
    take = kept[2].get((batch, device))
    if take is None:
        take = kept[2][(batch, device)] = _Padded(batch, device)
    return take


class _DevicePadded(_Padded):
    """Every sequence of the pack padded to one length, planned from the offsets on the device: no host read, so
    a packed step captures in a CUDA graph and replays with new offsets of the same count. The length is the
    caller's max_seqlen rounded up to PAD_UNIT (offsets.declare_max_seqlen), so a pack costs num_seqs full-length
    rows: equal lengths pay only the copies; one long sequence among many short ones pays for padding every short
    one to its length (the eager path's buckets do not, but they read the offsets). Offsets that break the
    contract are clamped into range here (no access outside the tensors) and the API makes the call's outputs NaN
    (offsets.invalid_on_device)."""

    def __init__(self, cu: torch.Tensor, total: int, length: int):
        n = cu.shape[0] - 1
        c = cu.long()
        starts = c[:-1].clamp(0, total)
        pos = torch.arange(length, device=cu.device)
        self.count, self.length = n, length
        self.valid = pos[None, :] < (c[1:] - c[:-1])[:, None]
        self.index = torch.where(self.valid, (starts[:, None] + pos[None, :]).clamp(max=total - 1), 0).flatten()
        token = torch.arange(total, device=cu.device)
        seq = (torch.searchsorted(c, token, right=True) - 1).clamp(0, n - 1)  # an empty sequence owns no token
        self.inverse = (seq * length + token - c[seq]).clamp(0, n * length - 1)

    def back(self, r: torch.Tensor, dim: int) -> torch.Tensor:
        """A result in rows' layout as the B = 1 pack: every token's row gathered (no scatter: deterministic)."""
        if dim == 1:
            return r.reshape(1, self.count * self.length, *r.shape[2:]).index_select(1, self.inverse)
        flat = r.transpose(0, 1).reshape(1, r.shape[1], self.count * self.length, *r.shape[3:])
        return flat.index_select(2, self.inverse)


def _on_device_plan(spec: PackedOp, impl: Callable, args: list, kwargs: dict, cu: torch.Tensor, total: int,
                    bound: int | None, metric: PackKL):
    """The op on the pack as one padded batch planned on the device (_DevicePadded), bounded by `bound` (the op's
    max_seqlen argument: torch.compile) or else the bound declared beside cu (CUDA graph capture)."""
    bound = bound if bound is not None else declared_max_seqlen(cu)
    if bound is None:
        raise RuntimeError("flash_msa: packed sequences under CUDA graph capture need the longest sequence's bound: "
                           "call flash_msa_varlen_func / flash_msa_warmup_varlen_func (max_seqlen), or "
                           "flash_msa_func with cu_seqlens (bound: seqlen); block_sparse_attention and "
                           "document_list read the offsets on the host and cannot be captured")
    plan = _DevicePadded(cu, total, padded_length(max(bound, 1)))
    piece = list(args)
    for i, dim in spec.tokens.items():
        if piece[i] is not None:
            piece[i] = plan.rows(piece[i], dim, float("inf") if i in spec.inf_pad else None)
    for i in spec.per_row:
        t = piece[i]
        if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[2] == total and total > 1:
            piece[i] = plan.rows(t, 2)
    result = impl(*piece, **metric.call_kwargs(kwargs, valid=plan.valid))
    if not isinstance(result, (tuple, list)):
        return plan.back(result, spec.outs[0])
    return tuple(plan.back(r, dim) for r, dim in zip(result, spec.outs))


def _front_padded(t: torch.Tensor, dim: int, a: int, length: int, pad: int, fill: float | None) -> torch.Tensor:
    """Tokens [a, a + length) of a B = 1 tensor along dim, after `pad` rows of fill (0, -1 in integer tensors)."""
    x = t.narrow(dim, a, length)
    if pad == 0:
        return x
    if fill is None:
        fill = 0 if t.is_floating_point() else -1
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([torch.full(shape, fill, dtype=t.dtype, device=t.device), x], dim=dim)


def _separate_keys(spec: PackedOp, impl: Callable, args: list, kwargs: dict, cu: torch.Tensor,
                   cu_k: torch.Tensor, used_k: torch.Tensor | None, total: int, metric: PackKL):
    """Separate query and key offsets on the fixed-length kernels: sequence n's L_q queries are the last of its L_k
    positions, so its query-side tensors get L_k - L_q rows in front (zeros, block indices -1, lse +inf where
    inf_pad) and run against a view of its L_k keys as one fixed-length sequence; the real rows of the query-side
    results come back, and the key-side results (gradients) add into the keys' rows, summed where the key ranges of
    several sequences overlap (seqused_k). Exact: every query row is computed from its own row and the keys alone,
    and a padded row has no selected block, a zero upstream gradient and a zero KL gradient, so it adds nothing to
    any key. Ops that take longer keys themselves (keys_longer: selection and the sparse MSA ops, whose kernels
    place their queries at the end of the keys) get the queries unpadded. The cost: one call per sequence and, in
    warmup (padded), the padding copies and the padded rows' dense attention."""
    q_bounds, k_starts = host_offsets(cu), host_offsets(cu_k)
    used = host_offsets(used_k) if used_k is not None else [b - a for a, b in zip(k_starts[:-1], k_starts[1:])]
    total_k = args[spec.keys[0]].shape[spec.tokens[spec.keys[0]]]
    calls = []
    streams = tuning_packed.choose(arch_of(args[0].device)).streams
    side = SideStreams(args[0].device, streams if len(q_bounds) > 2 else 1)  # one query sequence: no side stream
    for n, (qa, qb) in enumerate(zip(q_bounds[:-1], q_bounds[1:])):
        L_q, ks, L_k = qb - qa, k_starts[n], used[n]
        if L_q == 0:
            continue
        pad = 0 if spec.keys_longer else L_k - L_q
        piece = list(args)
        for i, dim in spec.tokens.items():
            if piece[i] is None:
                continue
            if i in spec.keys:
                piece[i] = piece[i].narrow(dim, ks, L_k)
            else:
                piece[i] = _front_padded(piece[i], dim, qa, L_q, pad, float("inf") if i in spec.inf_pad else None)
        for i in spec.per_row:
            t = piece[i]
            if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[2] == total and total > 1:
                piece[i] = _front_padded(t, 2, qa, L_q, pad, None)
        calls.append((pad, ks, L_q, L_k, side.run(n, impl, piece, metric.call_kwargs(kwargs, rows=(pad, L_q)))))
    side.join()
    results = [(result,) if not isinstance(result, (tuple, list)) else tuple(result) for *_, result in calls]
    single = not isinstance(calls[-1][-1], (tuple, list))
    ranges = [(ks, L_k) for _, ks, _, L_k, _ in calls]
    out = []
    for j, dim in enumerate(spec.outs):
        if j in spec.key_outs:
            out.append(_summed_key_results([r[j] for r in results], ranges, dim, total_k))
        else:
            out.append(torch.cat([r[j].narrow(dim, pad, L_q) for r, (pad, _, L_q, _, _) in zip(results, calls)],
                                 dim=dim))
    return out[0] if single else tuple(out)


def _summed_key_results(parts: list[torch.Tensor], ranges: list[tuple[int, int]], dim: int, total_k: int):
    """The keys' results (gradients) of several calls, part n covering keys [ks, ks + L_k) of ranges[n], as one
    tensor of total_k keys along dim: each key the sum over the parts that cover it, in part order, in fp32 (fp64
    for fp64), cast once; 0 where none does. Written segment by segment between the ranges' ends, so a key covered
    once is a copy and only overlaps (one context-parallel rank's chunks share their prefix) are summed: no
    full-length fp32 buffer (at 1M tokens in (b) dk and dv would take 4 GiB each)."""
    like = parts[0]
    shape = list(like.shape)
    shape[dim] = total_k
    out = like.new_empty(shape)
    acc_dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    cuts = sorted({0, total_k, *(ks for ks, _ in ranges), *(ks + n for ks, n in ranges)})
    for a, b in zip(cuts[:-1], cuts[1:]):
        covering = [(p, ks) for p, (ks, n) in zip(parts, ranges) if ks <= a and b <= ks + n]
        seg = out.narrow(dim, a, b - a)
        if not covering:
            seg.zero_()
        elif len(covering) == 1:
            p, ks = covering[0]
            seg.copy_(p.narrow(dim, a - ks, b - a))
        else:
            acc = torch.zeros_like(seg, dtype=acc_dtype)
            for p, ks in covering:
                acc.add_(p.narrow(dim, a - ks, b - a))
            seg.copy_(acc)
    return out


def _assemble(parts, outs, total: int):
    """The pack's results from each batch's: concatenated where every batch is a run of views (in token order),
    else placed token by token."""
    if all(take is None for _, take, _ in parts):
        if len(parts) == 1:  # one run covers the pack: its results are the pack's (no copy)
            return tuple(_unrows(r, dim) for r, dim in zip(parts[0][2], outs))
        return tuple(torch.cat([_unrows(res[n], dim) for _, _, res in parts], dim=dim) for n, dim in enumerate(outs))
    fulls = []
    for n, dim in enumerate(outs):
        r = parts[0][2][n]
        shape = (1, total, *r.shape[2:]) if dim == 1 else (1, r.shape[1], total, *r.shape[3:])
        full = r.new_empty(shape)
        for batch, take, res in parts:
            if take is None:
                full.narrow(dim, batch.start, batch.count * batch.length).copy_(_unrows(res[n], dim))
            else:
                take.put(full, res[n], dim)
        fulls.append(full)
    return tuple(fulls)


class SideStreams:
    """A pack's calls are independent: with streams > 1 they run round-robin on that many side streams of the
    device (each waiting for the current stream's work so far), so several small calls can fill the GPU together;
    join() makes the current stream wait for all of them. The caching allocator is told who uses what: a call's
    arguments (often copies made on the current stream, e.g. padded rows, released when the caller moves on) are
    recorded on its side stream, and its results on the current stream, so neither memory is handed to another
    stream's allocation while still in use. streams = 1 (or a CPU tensor) runs every call on the current stream."""

    def __init__(self, device: torch.device, streams: int):
        self.main = torch.cuda.current_stream(device) if device.type == "cuda" and streams > 1 else None
        self.pool = _stream_pool(device, streams) if self.main is not None else ()
        self.used: set = set()

    def run(self, n: int, impl: Callable, args: list, kwargs: dict):
        if self.main is None:
            return impl(*args, **kwargs)
        stream = self.pool[n % len(self.pool)]
        stream.wait_stream(self.main)
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(stream)
        with torch.cuda.stream(stream):
            result = impl(*args, **kwargs)
        self.used.add(stream)
        for t in (result if isinstance(result, (tuple, list)) else (result,)):
            if isinstance(t, torch.Tensor):
                t.record_stream(self.main)
        return result

    def join(self):
        for stream in self.used:
            self.main.wait_stream(stream)


@functools.lru_cache(maxsize=16)
def _stream_pool(device: torch.device, streams: int) -> tuple:
    return tuple(torch.cuda.Stream(device) for _ in range(streams))


def per_sequence(op: str, impl: Callable, fallback: Callable) -> Callable:
    """impl (fixed length) made to take the op's cu_seqlens: without it impl runs as is; with it, once per batch
    (batches(): runs of consecutive equal-length sequences on views of the pack, and for the sparse ops padded
    buckets), the results put together. A pack without tokens runs `fallback` (the reference: nothing to launch)."""
    spec = SPECS[op]

    def run(*args, **kwargs):
        args = list(args)
        cu = args[spec.cu] if len(args) > spec.cu else kwargs.pop("cu_seqlens", None)
        cu_k, used_k = kwargs.pop("cu_seqlens_k", None), kwargs.pop("seqused_k", None)
        if len(args) > spec.cu:
            args[spec.cu] = None
        if cu is None:
            return impl(*args, **kwargs)
        total = args[0].shape[1]
        if cu_k is not None:
            if total:
                metric = PackKL.take(kwargs, total)
                return metric.written(_separate_keys(spec, impl, args, kwargs, cu, cu_k, used_k, total, metric))
            args[spec.cu] = cu  # no query: the reference gives the keys their zero gradients
            offsets = {"cu_seqlens_k": cu_k, **({"seqused_k": used_k} if used_k is not None else {})}
            return fallback(*args, **kwargs, **offsets)
        bound = plan_bound()
        if (bound is not None or capturing(cu)) and total:
            args[spec.cu] = None
            metric = PackKL.take(kwargs, total)
            out = _on_device_plan(spec, impl, args, kwargs, cu, total, bound, metric)
            return metric.written(out)
        spans = sequence_spans(cu)
        if not spans:
            args[spec.cu] = cu
            return fallback(*args, **kwargs)
        metric = PackKL.take(kwargs, total)
        parts, single = [], False
        policy = tuning_packed.choose(arch_of(args[0].device))
        calls = batches(spans, spec.paddable, policy.call_pairs, policy.merge_max_length)
        side = SideStreams(args[0].device, policy.streams if len(calls) > 1 else 1)
        for n, batch in enumerate(calls):
            take = _padded(cu, batch, args[0].device) if batch.members else None

            def rows(t, dim, fill=None, take=take, batch=batch):
                return take.rows(t, dim, fill) if take else _rows(t, dim, batch.start, batch.length, batch.count)

            piece = list(args)
            for i, dim in spec.tokens.items():
                if piece[i] is not None:
                    piece[i] = rows(piece[i], dim, float("inf") if i in spec.inf_pad else None)
            for i in spec.per_row:
                t = piece[i]
                if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[2] == total and total > 1:
                    piece[i] = rows(t, 2)
            result = side.run(n, impl, piece, metric.call_kwargs(kwargs, keep=take.keep if take else None))
            single = not isinstance(result, (tuple, list))
            parts.append((batch, take, (result,) if single else tuple(result)))
        side.join()
        out = _assemble(parts, spec.outs, total)
        return metric.written(out[0] if single else out)

    return run
