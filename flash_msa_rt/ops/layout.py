"""Between the public layouts and the runtime's (B, S, heads, D), and from document ids to cu_seqlens.

Layout changes are free views (transpose); contiguity is the backend's business, so a kernel that takes any
batch/seq/head strides never pays for a copy.
"""

from __future__ import annotations

import torch


def to_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """(B, H, S, D) "bhsd" or (B, S, H, D) "bshd" -> a (B, S, H, D) view."""
    return t.transpose(1, 2) if layout == "bhsd" else t


def from_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, S, H, D) tensor as a view in the user's layout."""
    return t.transpose(1, 2) if layout == "bhsd" else t


def flatten_batch(t: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (1, B * S, H, D): batch rows as consecutive packed sequences (a view when possible)."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


def cu_seqlens_from_document_list(document_list: torch.Tensor) -> torch.Tensor:
    """int32 offsets over the flattened (B * S) tokens: a sequence starts at each row start and at each id change.

    Synchronises the host with the device (the number of sequences is data dependent).
    """
    B, S = document_list.shape
    ids = document_list.reshape(-1)
    starts = torch.zeros(B * S, dtype=torch.bool, device=ids.device)
    starts[1:] = ids[1:] != ids[:-1]
    starts[::S] = True
    offsets = torch.nonzero(starts).reshape(-1)
    end = torch.tensor([B * S], dtype=offsets.dtype, device=offsets.device)
    return torch.cat([offsets, end]).to(torch.int32)

