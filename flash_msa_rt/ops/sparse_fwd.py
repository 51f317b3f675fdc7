"""The sparse forward's launcher: MSA main attention + proxy lse + KL on the GPU, KV-outer.

Steps, all on the device with no host synchronisation:
  1. sparse_plan: the reverse index (key block -> the queries that chose it), cut into bounded work items;
  2. sparse_fwd kernel: per (entry, head) the one-block partial output, its lse, and the proxy's lse;
  3. sparse_combine kernel: logsumexp merge of each row's K slots -> out, lse, lse_proxy;
  4. sparse_kl kernel: with the final lse and proxy lse, each entry's share of its row's KL;
  5. combine_kl: kl_rows.
Internal layout (B, S, heads, D); the public API validates user input and routes here through dispatch.
"""

from __future__ import annotations

import torch

from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops.sparse_plan import combine_kl, sparse_plan

DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
HEAD_DIMS = (128,)
BLOCK_SIZES = (128,)
GROUPS = (1, 2, 4, 8, 16)
TILE_M = 128
TILES_PER_ITEM = 4  # a work item is one key block and at most 4 tiles of its queries: bounds the hot blocks


def kernel_config(dtype: str, head_dim: int, proxy_head_dim: int, block_size: int, group: int) -> dict:
    """The variant launched for a problem; fields in the order the build names them."""
    return {"dtype": dtype, "head_dim": head_dim, "proxy_head_dim": proxy_head_dim, "block_size": block_size,
            "group": group, "tile_m": TILE_M, "threads": 256, "stages": 2}


def combine_config(dtype: str, head_dim: int, block_size: int, group: int) -> dict:
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group, "threads": 256}


def variants(dtype: str, head_dim: int, proxy_head_dim: int, block_size: int, group: int) -> list[tuple[str, dict]]:
    """Every (op, config) one forward launches."""
    main = kernel_config(dtype, head_dim, proxy_head_dim, block_size, group)
    return [("sparse_fwd", main), ("sparse_kl", main),
            ("sparse_combine", combine_config(dtype, head_dim, block_size, group))]


def unsupported_reason(q_proxy, k_proxy, q, k, block_size) -> str | None:
    """Why the kernels cannot run this problem (None when they can). Shapes are validated by the caller."""
    H, D, Hk = q.shape[2], q.shape[3], k.shape[2]
    Hp, Dp, Hpk = q_proxy.shape[2], q_proxy.shape[3], k_proxy.shape[2]
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (sparse kernels: bfloat16, float16)"
    if D not in HEAD_DIMS or Dp not in HEAD_DIMS:
        return f"head dims D={D}, Dp={Dp} (sparse kernels: {HEAD_DIMS})"
    if block_size not in BLOCK_SIZES:
        return f"block_size {block_size} (sparse kernels: {BLOCK_SIZES})"
    if H // Hp not in GROUPS:
        return f"G = H / Hp = {H // Hp} (sparse kernels: {GROUPS})"
    if Hp % Hk:
        return f"Hp = {Hp} proxy heads for Hk = {Hk} KV heads (sparse kernels: Hp a multiple of Hk)"
    return None


def _launch_args(q_proxy, k_proxy, q, k, plan, scale):
    return dict(q=q, k=k, q_proxy=q_proxy, k_proxy=k_proxy, entry_query=plan.entry_query,
                entry_dest=plan.entry_dest, items=plan.items, scale=float(scale),
                hp_per_hk=q_proxy.shape[2] // k.shape[2], hp_per_hpk=q_proxy.shape[2] // k_proxy.shape[2])


def msa_forward_cuda(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale):
    """(out (B, S, H, D), lse (B, H, S), lse_proxy (B, Hp, S), kl_rows (B, Hp, S)) on a CUDA device.

    The caller has validated shapes and made every tensor 16-byte aligned with a unit-stride head dim.
    Extra memory: the plan (O(B*Hp*S*K) int32) and the per-slot partial outputs (B*H*S*K*D elements, the
    combine's input; NOTES.md says how to bound it).
    """
    B, S, H, D = q.shape
    Hp = q_proxy.shape[2]
    G = H // Hp
    config = kernel_config(DTYPES[q.dtype], D, q_proxy.shape[3], block_size, G)
    plan = sparse_plan(block_indices, block_size, S, G, TILE_M // G, TILES_PER_ITEM)
    E = plan.entry_query.shape[0]
    dev = q.device
    o_part = torch.empty((E, G, D), dtype=q.dtype, device=dev)
    lse_part = torch.empty((E, G), dtype=torch.float32, device=dev)
    lsep_part = torch.empty((E,), dtype=torch.float32, device=dev)
    args = _launch_args(q_proxy, k_proxy, q, k, plan, scale)
    if E and plan.items.shape[0]:
        get_kernel("sparse_fwd", config, dev)(v=v, o_part=o_part, lse_part=lse_part, lsep_part=lsep_part, **args)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=dev)
    lse_proxy = torch.empty((B, Hp, S), dtype=torch.float32, device=dev)
    get_kernel("sparse_combine", combine_config(DTYPES[q.dtype], D, block_size, G), dev)(
        block_indices=block_indices, o_part=o_part, lse_part=lse_part, lsep_part=lsep_part, out=out, lse=lse,
        lse_proxy=lse_proxy)
    kl_part = torch.empty((E, G), dtype=torch.float32, device=dev)
    if E and plan.items.shape[0]:
        get_kernel("sparse_kl", config, dev)(lse=lse, lse_proxy=lse_proxy, kl_part=kl_part, **args)
    kl_rows = combine_kl(plan, block_indices, kl_part)
    return out, lse, lse_proxy, kl_rows
