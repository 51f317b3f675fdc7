"""The configuration matrix of the contract (docs/msa-semantics.md): the head dims and key blocks every main kernel
family is written for, and the part of it the default build (the published wheel) carries.

Head dim and key block are compile-time parameters of one kernel per family, never files per configuration. A
family whose variant at some point of the matrix cannot be built (registers, shared memory) refuses it in its
can_implement with the measurement; `python -m build_tools list --head-dim ... --block-size ...` shows why.
This module does not import cutlass.
"""

from __future__ import annotations

from typing import Iterable

from flash_msa_rt.tuning.head_dim import (forward_stages, gather_stages, kernel_block_size,  # noqa: F401
                                           wide)  # (the families' rules)

HEAD_DIMS = (64, 128, 256)  # D of the main heads (and of the proxy in the kernels that take both at one width)
PROXY_HEAD_DIMS = (64, 128)  # Dp
BLOCK_SIZES = (64, 128)  # Bs

# What a build compiles when no --head-dim / --block-size is named: the configurations most models use
# (gpt-oss-style D 64, Llama / MiniMax-M3-style D 128, blocks of 128). Every other point builds on request.
DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_BLOCK_SIZES = (128,)


def head_dims(chosen: Iterable[int] | None) -> tuple[int, ...]:
    """The head dims a family's configs() enumerates: those chosen, else the default build's."""
    return tuple(chosen) if chosen else DEFAULT_HEAD_DIMS


def block_sizes(chosen: Iterable[int] | None) -> tuple[int, ...]:
    return tuple(chosen) if chosen else DEFAULT_BLOCK_SIZES


def proxy_head_dims(chosen: Iterable[int] | None) -> tuple[int, ...]:
    """The Dp a proxy-only family (selection, its scores and quantiser) builds for the main head dims chosen: every
    Dp of the contract not above one of them (a proxy is never wider than the heads it serves in the default
    matrix), else both."""
    if not chosen:
        return PROXY_HEAD_DIMS
    return tuple(dp for dp in PROXY_HEAD_DIMS if any(dp <= d for d in chosen)) or tuple(chosen)


def kernel_block_sizes(head_dim: int, chosen: Iterable[int] | None) -> tuple[int, ...]:
    """The key blocks a main family builds at head dim D for the selections chosen (default: the default build's):
    the kernels' own block, which at D 256 is 64 for either selection (flash_msa_rt.tuning.head_dim)."""
    return tuple(sorted({kernel_block_size(head_dim, bs) for bs in block_sizes(chosen)}))


def any_kernel_block_sizes(head_dims_chosen: Iterable[int] | None, chosen: Iterable[int] | None) -> tuple[int, ...]:
    """kernel_block_sizes over every head dim chosen: what a family without a head dim (the plan kernels, the KL
    combine) builds so that each main configuration requested has its plans."""
    return tuple(sorted({b for d in head_dims(head_dims_chosen) for b in kernel_block_sizes(d, chosen)}))
