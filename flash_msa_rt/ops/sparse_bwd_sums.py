"""Fixed-order sums of the deterministic backward's partial rows (kernels_src.sparse_bwd, deterministic = 1).

The atomic kernels add a query's dq rows from every item that holds one of its K slots, and a key block's dk / dv
(dk_p) rows from every item of its list (long lists are cut into several items; proxy heads share KV heads): the
order of those fp32 additions changes from run to run. The deterministic kernels store the same rows instead, dq
per plan entry and dk / dv per item, and these functions add them up in an order that only the plan decides:
  - dq of (b, p, i): its K slots in slot order, by embedding_bag (one sequential sum per bag and feature);
  - dk of (b, KV head, block j): the items that target it in item order, by index_put_ with accumulate (on CUDA it
    sorts the indices with a stable radix sort and adds each run of equal indices in that order).
Every size comes from shapes: nothing here synchronises the host with the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_msa_rt.ops.sparse_plan import SparsePlan, live_slots


def slot_entries(plan: SparsePlan, block_indices: torch.Tensor) -> torch.Tensor:
    """int64 (B * Hp * S, K): for each slot (b, p, i, slot) of the plan's chunk, the plan-order row e of its partial
    rows, or E (the zero row after them) where the slot is dead (no entry of any item)."""
    E, dev = plan.E, block_indices.device
    row = torch.empty(E, dtype=torch.int64, device=dev)
    row[plan.entry_dest.long()] = torch.arange(E, dtype=torch.int64, device=dev)  # entry_dest permutes range(E)
    live = live_slots(block_indices, plan.block_size, plan.query_offset).reshape(-1)
    return torch.where(live, row, torch.full((), E, dtype=torch.int64, device=dev)).view(-1, plan.K)


def sum_slots(part: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(bags, F) fp32: per row of slots, the sum of the part rows (E + 1, F) it lists, in slot order (row E, the dead
    slots' row, must be zero)."""
    return F.embedding_bag(slots, part, mode="sum")


def item_targets(items: torch.Tensor, heads: int, per_head: int, head0: int, n_heads: int, n_blocks: int,
                 batch: int) -> torch.Tensor:
    """int64 (W,): the row of item (bp, j, start, n) in a (batch * n_heads * n_blocks + 1, Bs, D) buffer of key-block
    gradients: (b * n_heads + head0 + p // per_head) * n_blocks + j, where bp = b * heads + p in the item's plan
    and per_head proxy heads share one of the n_heads (KV or proxy key) heads; the last, spare row for the items
    past the real count (n = 0: the kernel wrote nothing there)."""
    bp, j, n = items[:, 0].long(), items[:, 1].long(), items[:, 3]
    b, p = torch.div(bp, heads, rounding_mode="floor"), bp.remainder(heads)
    row = (b * n_heads + head0 + torch.div(p, per_head, rounding_mode="floor")) * n_blocks + j
    spare = torch.full((), batch * n_heads * n_blocks, dtype=torch.int64, device=items.device)
    return torch.where(n > 0, row, spare)


def add_items(blocks: torch.Tensor, targets: torch.Tensor, part: torch.Tensor) -> None:
    """blocks[targets[w]] += part[w] for every item w, in item order per target (index_put_ with accumulate)."""
    blocks.index_put_((targets,), part, accumulate=True)


def blocks_to_rows(blocks: torch.Tensor, batch: int, n_heads: int, seqlen: int, dtype: torch.dtype) -> torch.Tensor:
    """(batch, seqlen, n_heads, D) in dtype from a key-block buffer (batch * n_heads * n_blocks + 1, Bs, D)."""
    d = blocks.shape[2]
    rows = blocks[:-1].view(batch, n_heads, -1, d)[:, :, :seqlen]
    out = torch.empty((batch, seqlen, n_heads, d), dtype=dtype, device=blocks.device)
    out.copy_(rows.transpose(1, 2))
    return out
