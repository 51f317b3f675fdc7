"""The deterministic backward's fixed summation orders (kernels_src.sparse_bwd, deterministic = 1).

The atomic kernels add a query's dq rows from every item that holds one of its K slots, and a key block's dk / dv
(dk_p) rows from every item of its list (long lists are cut into several items; proxy heads share KV heads): the
order of those fp32 additions changes from run to run. The deterministic kernels fix both orders:
  - dq (dq_p) rows are stored, not added, at their slot's row of a partial buffer (the plan's entry_dest: row
    ((b * Hp + p) * S + i) * K + slot), and the slot_sum kernel adds a query's live slots' rows in slot order
    (slot_sums states it in torch); dead slots' rows are never written nor read;
  - the items that add into the same key-block rows take turns in item order: item_turns gives each item the
    item before it on those rows, whose flag the kernel waits for before its own atomics (kernels_src.atomics).
Every size comes from shapes: nothing here synchronises the host with the device.
"""

from __future__ import annotations

import torch

from flash_msa_rt.ops.sparse_plan import live_slots

_BLOCKS = 1 << 31  # more key blocks than any sequence has: (b, head, j) -> one int64 row key


def slot_sums(part: torch.Tensor, block_indices: torch.Tensor, block_size: int, query_offset: int = 0) -> torch.Tensor:
    """The slot_sum kernel's contract in torch: (B, S, Hp * G, D) fp32, row (b, i, p * G + g) the sum over the
    live slots k of (b, p, i), in order k = 0 .. K-1, of part[((b * Hp + p) * S + i) * K + k, g] (part (E, G, D)
    fp32); dead slots' rows are not read (they may hold anything). Row i of block_indices is query
    query_offset + i."""
    B, Hp, S, K = block_indices.shape
    G, D = part.shape[1:]
    rows = part.view(B, Hp, S, K, G, D)
    live = live_slots(block_indices, block_size, query_offset)
    out = torch.zeros((B, Hp, S, G, D), dtype=torch.float32, device=part.device)
    for k in range(K):
        out += torch.where(live[:, :, :, k, None, None], rows[:, :, :, k], 0.0)
    return out.permute(0, 2, 1, 3, 4).reshape(B, S, Hp * G, D)


def item_turns(items: torch.Tensor, heads: int, per_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(item_prev, item_done) int32 (W,) of a plan's items (bp, j, start, n), bp = b * heads + p: item_prev[w] is
    the item before w (in item order) that adds into the same rows, key block j of head p // per_head of batch b
    (per_head proxy heads share a KV or proxy-key head), or -1; item_done are the flags, zero. Items past the real
    count (n = 0) neither wait nor signal, and no item waits for one."""
    W, dev = items.shape[0], items.device
    bp, j, n = items[:, 0].long(), items[:, 1].long(), items[:, 3]
    b, p = torch.div(bp, heads, rounding_mode="floor"), bp.remainder(heads)
    rows = (b * heads + torch.div(p, per_head, rounding_mode="floor")) * _BLOCKS + j
    w = torch.arange(W, dtype=torch.int64, device=dev)
    rows = torch.where(n > 0, rows, -1 - w)  # a row of its own for each spare item
    if per_head == 1:
        # Items are list-major (bp, j, chunk): one head's items of a block are adjacent, no sort needed.
        order, sorted_rows = w, rows
    else:
        sorted_rows, order = torch.sort(rows, stable=True)
    same = torch.zeros(W, dtype=torch.bool, device=dev)
    same[1:] = sorted_rows[1:] == sorted_rows[:-1]
    before = torch.full((W,), -1, dtype=torch.int64, device=dev)
    before[1:] = order[:-1]
    prev = torch.where(same, before, -1).to(torch.int32)
    if per_head != 1:  # back to item order (order is a permutation: index_copy_ is deterministic)
        prev = torch.empty_like(prev).index_copy_(0, order, prev)
    return prev, torch.zeros(W, dtype=torch.int32, device=dev)
