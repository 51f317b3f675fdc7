"""block_sparse_attention (NSA / FSA selected attention) on the MSA sparse kernels.

A given selection is MSA's main attention without the proxy: index head i of Hi serves the H / Hi query heads
[i * H / Hi, (i + 1) * H / Hi), as proxy head p serves G = H / Hp in MSA. The kernels need all query heads of one
index head to share a KV head (Hp a multiple of Hk), so the indices are widened to lcm(Hi, Hk) kernel index heads
(a gather of int32 rows; none when Hk divides Hi), and G = H / lcm(Hi, Hk) must be one the kernels are built for.

msa-semantics.md counts a block listed twice in a row once, while the kernels' plan wants distinct blocks per row
(one entry per query per reverse list): each row is sorted and its repeats become empty slots, on the forward and
again, identically, on the backward.

Forward: sparse_fwd.msa_forward_cuda without the KL pass (plan, sparse_fwd, sparse_combine). Backward: bwd_delta and
the main sparse_bwd kernel (no proxy, no tau), in chunks of heads whose plans stay within int32. No host
synchronisation in either; the range check of the indices is the caller's (flash_msa_rt.ops.kernels).
"""

from __future__ import annotations

import math

import torch

from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops import sparse_bwd, sparse_fwd
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.ops.sparse_plan import chunk_plans, list_kernel_configs

_INT32_LIMIT = 1 << 31


def kernel_heads(H: int, Hk: int, Hi: int) -> int:
    """Index heads the kernels run: lcm(Hi, Hk), so that each serves query heads of one KV head and one index
    head (H is a multiple of both, hence of their lcm)."""
    return Hi * Hk // math.gcd(Hi, Hk)


def kernel_group(H: int, Hk: int, Hi: int) -> int:
    """G of the kernels: query heads per kernel index head."""
    return H // kernel_heads(H, Hk, Hi)


def kernel_indices(block_indices: torch.Tensor, H: int, Hk: int) -> torch.Tensor:
    """int32 (B, lcm(Hi, Hk), S, K), contiguous: each row of block_indices (B, Hi, S, K) with its blocks distinct
    (sorted; a repeat becomes -1) and widened to the kernel index heads (kernel head p' takes the row of index head
    p' * G' // (H / Hi), G' = kernel_group)."""
    B, Hi, S, K = block_indices.shape
    idx = block_indices.to(torch.int32)
    if K > 1:
        idx = torch.sort(idx, dim=-1).values
        repeat = torch.cat([torch.zeros_like(idx[..., :1], dtype=torch.bool), idx[..., 1:] == idx[..., :-1]], -1)
        idx = torch.where(repeat, torch.full((), -1, dtype=torch.int32, device=idx.device), idx)
    L = kernel_heads(H, Hk, Hi)
    if L != Hi:
        source = torch.arange(L, device=idx.device) * (H // L) // (H // Hi)
        idx = idx.index_select(1, source)
    return idx.contiguous()


def block_sparse_forward_cuda(q, k, v, block_indices, block_size, scale):
    """(out (B, S, H, D) q.dtype, lse (B, H, S) fp32): causal attention of each row over its listed blocks.
    Tensors validated, 16-byte aligned, unit-stride head dim; block_indices values in [-1, ceil(S / block_size))."""
    sel = kernel_indices(block_indices, q.shape[2], k.shape[2])
    out, lse, _, _ = sparse_fwd.msa_forward_cuda(None, None, q, k, v, sel, block_size, scale)
    return out, lse


def block_sparse_backward_cuda(q, k, v, out, lse, block_indices, block_size, scale, grad_out):
    """(dq, dk, dv) of block_sparse_forward_cuda; grad_out (B, S, H, D) or None (zero gradients)."""
    B, S, H, D = q.shape
    Hk = k.shape[2]
    if grad_out is None or q.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    sel = kernel_indices(block_indices, H, Hk)
    Hp, K = sel.shape[1], sel.shape[3]
    G = H // Hp
    dt, dev, f32 = sparse_fwd.DTYPES[q.dtype], q.device, torch.float32
    t = sparse_bwd.choice(arch_of(dev), G, D, block_size, B, S, H)
    main = get_kernel("sparse_bwd", sparse_bwd.kernel_config(dt, D, block_size, G, t), dev)
    delta = torch.empty((B, H, S), dtype=f32, device=dev)
    get_kernel("bwd_delta", sparse_bwd.delta_config(dt, D), dev)(dout=grad_out, out=out, delta=delta)
    flat, (dq_acc, dk_acc, dv_acc) = sparse_bwd.accumulators((q, k, v))
    # Chunks of index heads whose plans index fewer than 2**31 (entry, head) rows (the plan's int32 arithmetic);
    # one chunk at every size the benchmarks run.
    c = sparse_fwd.heads_per_chunk(B * S * K * G, Hp, Hk, Hp, _INT32_LIMIT - 1)
    plans = chunk_plans(sel, block_size, G, c, S, ((sparse_bwd.TILE_M // G, t.tiles_per_item),), t.item_order,
                        arch=arch_of(dev), bin_queries=t.bin_queries)
    lse = lse.contiguous()
    for hc in sparse_fwd.head_chunks(Hp, Hk, Hp, G, c):
        (plan,) = plans[(hc.p0, 0)]
        main(q=hc.view(q, 2, "main"), k=hc.view(k, 2, "kv"), v=hc.view(v, 2, "kv"), dout=hc.view(grad_out, 2, "main"),
             lse=hc.view(lse, 1, "main"), delta=hc.view(delta, 1, "main"), entry_query=plan.entry_query,
             items=plan.items, dq_acc=hc.view(dq_acc, 2, "main"), dk_acc=hc.view(dk_acc, 2, "kv"),
             dv_acc=hc.view(dv_acc, 2, "kv"), scale=float(scale), hp=c, hp_per_hk=hc.per_kv)
    return tuple(sparse_bwd.cast_accumulators(flat, (q, k, v)))


def variants(dtype: str, head_dim: int, block_size: int, group: int, arch: str = "sm90a",
             backward: bool = False) -> list[tuple[str, dict]]:
    """Every (op, config) the block-sparse forward (or backward) launches on arch."""
    if backward:
        t = sparse_bwd.choice(arch, group, head_dim, block_size)
        return [("sparse_bwd", sparse_bwd.kernel_config(dtype, head_dim, block_size, group, t)),
                ("bwd_delta", sparse_bwd.delta_config(dtype, head_dim))] + list_kernel_configs(block_size, arch=arch)
    t = sparse_fwd.choice(arch, group, head_dim, block_size)
    return [("sparse_fwd", sparse_fwd.kernel_config(dtype, head_dim, block_size, group, t)),
            ("sparse_combine", sparse_fwd.combine_config(dtype, head_dim, block_size, group, t))] + \
        list_kernel_configs(block_size, arch=arch)
