"""Validation branches no other test reached (issue 40): zero-sized heads and head dims, an empty proxy pair, a
document_list on another device, an empty block-sparse problem. Each raises ValueError naming the argument, its
value and what is required (CPU: validation runs before any backend)."""

from __future__ import annotations

import re

import pytest
import torch

import flash_msa_rt

B, S = 1, 64


def _r(*shape):
    return torch.randn(*shape)


def _msa(qp=(1, 16), kp=(1, 16), q=(4, 16), kv=(1, 16), **kwargs):
    """flash_msa_func on (heads, head_dim) of each input, bhsd."""
    return flash_msa_rt.flash_msa_func(_r(B, qp[0], S, qp[1]), _r(B, kp[0], S, kp[1]), _r(B, q[0], S, q[1]),
                                       _r(B, kv[0], S, kv[1]), _r(B, kv[0], S, kv[1]), 128, **kwargs)


@pytest.mark.parametrize("shapes, what", [
    (dict(q=(0, 16)), "heads of q is 0"),
    (dict(qp=(0, 16)), "heads of q_proxy is 0"),
    (dict(q=(4, 0), kv=(1, 0)), "head_dim of q is 0"),
    (dict(qp=(1, 0), kp=(1, 0)), "head_dim of q_proxy is 0"),
])
def test_msa_zero_heads_or_head_dim(shapes, what):
    with pytest.raises(ValueError, match=f"flash_msa_func: {what}; it must be positive"):
        _msa(**shapes)


@pytest.mark.parametrize("qp, kp", [((B, 0, S, 16), (B, 1, S, 16)), ((B, 2, S, 16), (B, 0, S, 16)),
                                    ((B, 1, 0, 16), (B, 1, 0, 16)), ((B, 1, S, 0), (B, 1, S, 0))])
def test_select_blocks_empty_proxy(qp, kp):
    bshd = lambda s: (s[0], s[2], s[1], s[3])  # noqa: E731  (the message names (batch, seqlen, heads, head_dim))
    with pytest.raises(ValueError, match=re.escape(
            f"select_blocks: q_proxy and k_proxy must have positive seqlen, heads and head_dim, got {bshd(qp)} and "
            f"{bshd(kp)} as (batch, seqlen, heads, head_dim)")):
        flash_msa_rt.select_blocks(_r(*qp), _r(*kp), 128)


def test_document_list_on_another_device():
    documents = torch.zeros(B, S, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="flash_msa_func: document_list is on meta but the inputs are on cpu"):
        _msa(document_list=documents)


@pytest.mark.parametrize("q, k", [((B, 0, S, 16), (B, 1, S, 16)), ((B, 4, S, 0), (B, 1, S, 0)),
                                  ((B, 4, 0, 16), (B, 1, 0, 16))])
def test_block_sparse_attention_empty_problem(q, k):
    bshd = lambda s: (s[0], s[2], s[1], s[3])  # noqa: E731
    idx = torch.zeros(B, 1, q[2], 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(
            f"block_sparse_attention: q and k must have positive seqlen, heads and head_dim, got q {bshd(q)} and "
            f"k {bshd(k)} as (batch, seqlen, heads, head_dim)")):
        flash_msa_rt.block_sparse_attention(_r(*q), _r(*k), _r(*k), idx, 32)
