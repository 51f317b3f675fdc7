"""A selection of key blocks as the main kernels take it: at D 256 a block of 128 keys is two blocks of 64
(flash_msa_rt.tuning.head_dim.kernel_block_size says why), so block j of a query's list becomes blocks 2j and
2j + 1 of 64 keys.

Exact: attention over the selected blocks depends only on the set of keys they cover, which the halves cover
exactly (the same keys, each once). A half with no causal key of a query (the second half of its own block, when
the query sits in the first) is dropped by the plan's live rule (sparse_plan: block j <= blk(i)), and a half past
the keys is written as -1 (an empty slot) so that no index leaves [-1, ceil(Sk / 64)). The split runs on the
device with no host sync, so it captures in a CUDA graph and traces under torch.compile.

The eager path's forward and backward see the same selection object; its split is kept on it (with its version),
so that both ops plan the same tensor and the backward reuses the forward's sorted lists (sparse_plan.kept_lists).
Custom ops keep nothing on their inputs (sparse_plan.ops_keep_no_lists: such a tensor would outlive a CUDA graph
tree's pool untracked) and split again.
"""

from __future__ import annotations

import torch

from flash_msa_rt.ops import sparse_plan
from flash_msa_rt.tuning.head_dim import kernel_block_size

_KEPT_SPLIT = "_flash_msa_split_blocks"


def kernel_selection(block_indices: torch.Tensor, block_size: int, head_dim: int,
                     keys: int) -> tuple[torch.Tensor, int]:
    """(the selection, its key block) as the main kernels at head_dim take it; keys: Sk, the key length."""
    kbs = kernel_block_size(head_dim, block_size)
    if kbs == block_size:
        return block_indices, block_size
    keep = sparse_plan.keeps_across_ops()
    kept = getattr(block_indices, _KEPT_SPLIT, None) if keep else None
    key = (block_indices._version, kbs, keys)
    if kept is not None and kept[0] == key:
        return kept[1], kbs
    split = split_blocks(block_indices, block_size // kbs, kbs, keys)
    if keep:
        setattr(block_indices, _KEPT_SPLIT, (key, split))
    return split, kbs


def split_blocks(block_indices: torch.Tensor, factor: int, kernel_block: int, keys: int) -> torch.Tensor:
    """(..., K) block indices -> (..., K * factor) of blocks factor times smaller: j -> j * factor + h for
    h < factor, in order; -1 (an empty slot) stays -1, as does a part that starts at or past `keys`."""
    part = torch.arange(factor, device=block_indices.device, dtype=block_indices.dtype)
    j = block_indices.unsqueeze(-1)
    fine = j * factor + part
    live = (j >= 0) & (fine * kernel_block < keys)
    return torch.where(live, fine, torch.full_like(fine, -1)).flatten(-2).contiguous()
