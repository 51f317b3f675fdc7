"""MSA and its warmup mode over a sequence sharded across the ranks of a process group (context parallelism).

Each rank all-gathers k_proxy, k and v (its queries select from and attend to the whole causal prefix, wherever it
lives) and runs the varlen op with separate key lengths on its own queries: its chunks of each batch row are query
sequences whose keys are the gathered row's first `end of chunk` tokens (cu_seqlens_k repeats the row's start,
seqused_k the chunk's end: no copy of the keys per chunk). The backward of the gather sums each key's gradient over
the ranks back to its owner. Semantics: the single-process op on the full sequence (docs/msa-semantics.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flash_msa_rt import api
from flash_msa_rt.distributed.sharding import (check_scheme, gather_sequence, group_of, pack_bounds, pack_starts,
                                              seqlen_of, spans_of)
from flash_msa_rt.ops import layout as _layout
from flash_msa_rt.ops import validation as _v

_NAMES = ("q_proxy", "k_proxy", "q", "k", "v")


def flash_msa_cp_func(q_proxy, k_proxy, q, k, v, top_k, scale=None, *, group=None, scheme="zigzag", layout="bhsd",
                      kl_value="exact", kl_metric=None, block_size=128, seqlen=None, select_precision="bf16",
                      cu_seqlens=None, sinks=None, proxy_scale=None, local_blocks=1):
    """flash_msa_func over this rank's shards of one batch of sequences (context parallelism).

    The five tensors are this rank's shards (shard_sequence's order: its chunks concatenated along the sequence
    dimension), laid out as flash_msa_func's (`layout`). group: a torch.distributed ProcessGroup, None for the
    default group; every rank of it calls this with the same arguments but its own shards. seqlen: the full
    sequence length where the caller knows it; None all-gathers the shard lengths (a host synchronisation).

    Returns (out_local (B, S_local, H * D), kl_loss). out_local holds this rank's rows. kl_loss holds the KL of the
    whole sequence (mean over every (b, p, i) of all ranks), the same value on every rank; its gradient reaches this
    rank's rows only, each with weight 1 / (B Hp S). So the sum over the ranks of each rank's gradient of
    (loss coefficient x kl_loss) is the single-process gradient: sum the ranks' parameter gradients (a context-
    parallel group's gradient all-reduce does) and the proxy trains exactly as without sharding. kl_value and
    kl_metric as flash_msa_func's ("deferred": the backward writes the whole sequence's KL into kl_metric on every
    rank). select_precision as flash_msa_func's: fp8 key blocks lie on the full sequence's block grid, and the one
    block a rank's key prefix cuts short is never a candidate of that rank's queries (their own block or a later
    one), so the selection is the single-process one.

    cu_seqlens: packed sequences, int32 offsets over the full stream (B = 1; every rank passes the same, read on the
    host): each sequence is split over the ranks on its own (shard_sequence(..., cu_seqlens=)), and the result is
    flash_msa_func(..., cu_seqlens=) on the full pack, kl_loss the mean over every (p, token) of the pack.

    sinks, proxy_scale, local_blocks as flash_msa_func's. sinks is the same (H,) tensor on every rank (a replicated
    parameter); each rank's gradient of it covers its own rows, so the group's gradient all-reduce (the one that
    sums the proxy's parameter gradients) gives the single-process d sinks.
    """
    return _cp("flash_msa_cp_func", True, q_proxy, k_proxy, q, k, v, top_k, scale, group, scheme, layout, kl_value,
               kl_metric, block_size, seqlen, select_precision, cu_seqlens,
               options=dict(sinks=sinks, proxy_scale=proxy_scale, local_blocks=local_blocks))


def flash_msa_warmup_cp_func(q_proxy, k_proxy, q, k, v, top_k, scale=None, *, group=None, scheme="zigzag",
                             layout="bhsd", kl_value="exact", kl_metric=None, block_size=128, seqlen=None,
                             cu_seqlens=None, sinks=None, proxy_scale=None, local_blocks=1):
    """flash_msa_warmup_func over this rank's shards: dense causal main attention over the whole prefix, the proxy
    trained by the KL over it; arguments and returns as flash_msa_cp_func's."""
    return _cp("flash_msa_warmup_cp_func", False, q_proxy, k_proxy, q, k, v, top_k, scale, group, scheme, layout,
               kl_value, kl_metric, block_size, seqlen, cu_seqlens=cu_seqlens,
               options=dict(sinks=sinks, proxy_scale=proxy_scale, local_blocks=local_blocks))


def rank_attention(sparse, q_proxy, k_proxy_full, q, k_full, v_full, spans, top_k, scale=None, *, block_size=128,
                   kl_value="exact", kl_metric=None, select_precision="bf16", starts=None, sinks=None,
                   proxy_scale=None, local_blocks=1):
    """One rank's compute, no communication: its query shards (B, L, heads, D) in shard order, covering `spans`
    (its [start, end) chunks of each row), against the gathered keys (B, S, heads, D). Each chunk of each row is a
    query sequence whose keys are its row's first `end` tokens (bottom-right causal: the chunk's queries are the
    last of them), one varlen call with separate key offsets, so no key is copied per chunk. Returns
    (out (B L, H, D), kl_loss over this rank's rows). flash_msa_cp_func calls it between the gather and the KL
    all-reduce; tests run it per rank on one device. starts: where each span's sequence starts when the row is a
    pack (sharding.pack_starts): a chunk's keys are its own sequence's, from that start to the chunk's end.
    sinks, proxy_scale and local_blocks as flash_msa_func's."""
    B, S = k_full.shape[0], k_full.shape[1]
    device = q.device
    starts = [0] * len(spans) if starts is None else starts
    used = [b - s0 for (_, b), s0 in zip(spans, starts)]
    q_lens = [b - a for _ in range(B) for a, b in spans]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([row * S + s0 for row in range(B) for s0 in starts] + [B * S], dtype=torch.int32,
                        device=device)
    used_k = torch.tensor(used * B, dtype=torch.int32, device=device)
    varlen = api.flash_msa_varlen_func if sparse else api.flash_msa_warmup_varlen_func
    selection = {"select_precision": select_precision} if sparse else {}
    flat = lambda t: t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])  # noqa: E731 - (B, S, h, d) -> (B S, h, d)
    return varlen(flat(q_proxy), flat(k_proxy_full), flat(q), flat(k_full), flat(v_full), cu_q,
                  max(q_lens, default=0), top_k, scale, block_size=block_size, cu_seqlens_k=cu_k,
                  max_seqlen_k=max(S, 1), seqused_k=used_k, kl_value=kl_value, kl_metric=kl_metric, sinks=sinks,
                  proxy_scale=proxy_scale, local_blocks=local_blocks, **selection)


class _AfterBackward(torch.autograd.Function):
    """Identity on x; its backward runs once the ops x feeds have run theirs, and then calls `then()` (the deferred
    KL value's all-reduce: every rank reaches it in the same order, as their graphs are the same)."""

    @staticmethod
    def forward(ctx, x, then):
        ctx.then = then
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.then()
        return grad, None


def _cp(fn, sparse, q_proxy, k_proxy, q, k, v, top_k, scale, group, scheme, layout, kl_value, kl_metric, block_size,
        seqlen, select_precision="bf16", cu_seqlens=None, options=None):
    check_scheme(fn, scheme)
    select_precision = _v.check_select_precision(fn, select_precision)
    _v.check_layout(fn, layout)
    kl_value = _v.check_kl_value(fn, kl_value, kl_metric)
    group, world, rank = group_of(fn, group)
    tensors = dict(zip(_NAMES, (q_proxy, k_proxy, q, k, v)))
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shown = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fn}: {name} must be a 4-D tensor {_v.LAYOUTS[layout]}, got {shown}")
    qp, kp, qq, kk, vv = (_layout.to_bshd(t, layout) for t in tensors.values())
    B, L = qq.shape[0], qq.shape[1]
    for name, t in zip(_NAMES, (qp, kp, qq, kk, vv)):
        if t.shape[1] != L:
            raise ValueError(f"{fn}: {name} holds {t.shape[1]} tokens of this rank's shard but q holds {L}; the five "
                             f"shards must cover the same tokens")
    bounds = None
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{fn}: cu_seqlens packs sequences along S of a batch of one row, but q has batch {B}; "
                             f"put the sequences one after another in a (1, total, ...) stream")
        total = int(cu_seqlens[-1]) if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.numel() else -1
        bounds = pack_bounds(fn, cu_seqlens, total if seqlen is None else seqlen)
        S = bounds[-1]
    else:
        S = seqlen_of(fn, L, group, world, seqlen)
    spans = [spans_of(S, world, r, scheme, bounds) for r in range(world)]
    empty = [r for r, sp in enumerate(spans) if sum(b - a for a, b in sp) == 0]
    if empty:  # every rank sees the same S and raises here, before any collective of the call
        chunks = 2 * world if scheme == "zigzag" else world
        raise ValueError(f"{fn}: seqlen {S} is too short for {world} ranks with scheme={scheme!r}: ranks {empty} would "
                         f"hold no tokens; the sequence needs at least {chunks} tokens ({scheme} cuts it into "
                         f"{chunks} chunks)")
    mine = spans[rank]
    if L != sum(b - a for a, b in mine):
        raise ValueError(f"{fn}: this rank's shards hold {L} tokens, but a {scheme} split of seqlen {S} over {world} "
                         f"ranks gives rank {rank} {sum(b - a for a, b in mine)} (check seqlen and scheme)")
    _v.check_kl_metric(fn, kl_metric, qq.device)

    local_metric = None
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (qp, kp, qq, kk, vv))
    if kl_value == "deferred" and kl_metric is not None and backward:
        local_metric = torch.zeros((), dtype=torch.float32, device=qq.device)
        share = L / S if S else 0.0

        def reduce_metric():  # this rank's KL share -> the whole sequence's KL, on every rank
            total = local_metric * share
            dist.all_reduce(total, group=group)
            kl_metric.copy_(total)

        first = next(i for i, t in enumerate((qp, kp, qq, kk, vv)) if t.requires_grad)
        ins = [qp, kp, qq, kk, vv]
        ins[first] = _AfterBackward.apply(ins[first], reduce_metric)
        qp, kp, qq, kk, vv = ins
    elif kl_value == "deferred" and kl_metric is not None:
        kl_value = "exact"  # no backward will run: the forward takes the value (msa-semantics.md)

    kp_full, k_full, v_full = (gather_sequence(t, group, spans, S) for t in (kp, kk, vv))
    out, kl_local = rank_attention(sparse, qp, kp_full, qq, k_full, v_full, mine, top_k, scale,
                                   block_size=block_size, kl_value=kl_value, kl_metric=local_metric,
                                   select_precision=select_precision,
                                   starts=None if bounds is None else pack_starts(bounds, scheme), **(options or {}))
    # kl_local = (sum of this rank's KL rows) / (Hp B L): its share of the whole mean is L / S of it.
    part = kl_local * (L / S) if S else kl_local * 0.0
    total = part.detach().clone()
    dist.all_reduce(total, group=group)
    kl_loss = part + (total - part.detach())  # the whole value, the gradient of this rank's rows only
    if kl_metric is not None and kl_value == "exact":
        kl_metric.copy_(total.float())
    return out.reshape(B, L, -1), kl_loss
