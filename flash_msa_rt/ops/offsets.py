"""Host copies of packed-sequence offsets (cu_seqlens), read once per tensor rather than once per op call.

Reading a device tensor on the host synchronises the host with the device. A packed training step reads its
offsets to validate them (flash_msa_rt.api) and again in every op that runs on the fixed-length kernels
(flash_msa_rt.ops.packed: selection, forward, KL pass, backward), in every layer: with one offsets tensor shared
by the layers, that was about five synchronisations per layer and step. Here a device tensor's values are kept
beside the tensor object and its version counter, so the first read of a step pays and the others do not; an
in-place change of the tensor (any torch write bumps its version) makes the next read fetch them again; a write
that bypasses torch (a raw pointer, a DLPack consumer) is not seen, so offsets changed that way need a new tensor.
Host tensors are read every time (cheap, and numpy can write them without a version bump).
"""

from __future__ import annotations

import weakref

import torch

_HOST: dict[int, tuple] = {}  # id(tensor) -> (weakref to it, its version when read, its values)


def _read(cu: torch.Tensor) -> tuple[int, ...]:
    return tuple(cu.tolist())


def _on_host(cu: torch.Tensor) -> bool:
    return cu.device.type == "cpu"


def _version(cu: torch.Tensor) -> int | None:
    try:
        return cu._version
    except RuntimeError:  # an inference-mode tensor tracks no version: never kept
        return None


def host_offsets(cu: torch.Tensor) -> tuple[int, ...]:
    """cu's values as ints; a device tensor is read once per version (one synchronisation)."""
    if _on_host(cu):
        return _read(cu)
    key, version = id(cu), _version(cu)
    kept = _HOST.get(key)
    if kept is not None and version is not None and kept[0]() is cu and kept[1] == version:
        return kept[2]
    values = _read(cu)
    if version is not None:
        _HOST[key] = (weakref.ref(cu, lambda _, key=key: _HOST.pop(key, None)), version, values)
    return values


# Under CUDA graph capture nothing may be read on the host, and a replay may see new offsets in the same tensor, so
# the packed ops plan on the device from a length bound the caller gives (max_seqlen), kept here beside the tensor
# as its host values are above: the ops' signatures carry offsets, not bounds.
_BOUND: dict[int, tuple] = {}  # id(tensor) -> (weakref to it, the longest sequence the caller allows)


def declare_max_seqlen(cu: torch.Tensor, max_seqlen: int) -> None:
    """The caller's bound on cu's sequence lengths (flash_msa_varlen_func's max_seqlen) for the ops it runs."""
    key = id(cu)
    _BOUND[key] = (weakref.ref(cu, lambda _, key=key: _BOUND.pop(key, None)), int(max_seqlen))


def declared_max_seqlen(cu: torch.Tensor) -> int | None:
    kept = _BOUND.get(id(cu))
    return kept[1] if kept is not None and kept[0]() is cu else None


def capturing(cu: torch.Tensor) -> bool:
    """Whether the ops on cu must not read it on the host: a CUDA graph is being captured on the current stream."""
    return cu.is_cuda and torch.cuda.is_current_stream_capturing()


def invalid_on_device(cu: torch.Tensor, total: int, max_seqlen: int, row_len: int | None = None) -> torch.Tensor:
    """0-dim bool on the device, no host read: cu breaks what validation.check_cu_seqlens_values and
    check_max_seqlen check on the host (starts at 0, ends at total, never decreases, no sequence longer than
    max_seqlen, every multiple of row_len present)."""
    c = cu.long()
    lengths = c[1:] - c[:-1]
    bad = (c[0] != 0) | (c[-1] != total) | (lengths < 0).any() | (lengths > max_seqlen).any()
    if row_len is not None:
        rows = torch.arange(0, total + 1, row_len, device=cu.device)
        bad = bad | ~torch.isin(rows, c).all()
    return bad
