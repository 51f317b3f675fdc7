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
