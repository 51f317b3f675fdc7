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

import contextlib
import contextvars
import weakref

import torch

_HOST: dict[int, tuple] = {}  # id(tensor) -> (weakref to it, its version when read, its HostOffsets)


class HostOffsets:
    """One read of an offsets tensor on the host and what the packed path derives from it, each formed once.
    Offsets built at a fixed size on the device (transformers' B * S + 1 entries, most of them empty sequences)
    hold ~65K entries at 64K tokens: the summaries below are vector operations over the CPU copy (Python loops
    over such a list took ~11 ms of host time per step, with the device idle behind the read's synchronisation:
    benchmarks/profile_m3.py at 63dbd7f)."""

    def __init__(self, values: torch.Tensor):
        self.tensor = values  # int64 on the CPU
        self._values = self._spans = None
        self.lengths = values[1:] - values[:-1]

    @property
    def values(self) -> tuple[int, ...]:
        if self._values is None:
            self._values = tuple(self.tensor.tolist())
        return self._values

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """[start, end) of every non-empty sequence, in order."""
        if self._spans is None:
            nonempty = (self.lengths > 0).nonzero().flatten()
            self._spans = tuple(zip(self.tensor[nonempty].tolist(), self.tensor[nonempty + 1].tolist()))
        return self._spans

    def longest(self) -> int:
        return int(self.lengths.max()) if self.lengths.numel() else 0


def _read(cu: torch.Tensor) -> torch.Tensor:
    return cu.to(device="cpu", dtype=torch.int64)


def _on_host(cu: torch.Tensor) -> bool:
    return cu.device.type == "cpu"


def _version(cu: torch.Tensor) -> int | None:
    try:
        return cu._version
    except RuntimeError:  # an inference-mode tensor tracks no version: never kept
        return None


def host_view(cu: torch.Tensor) -> HostOffsets:
    """cu read on the host (a device tensor once per version: one synchronisation), with its summaries."""
    if _on_host(cu):
        return HostOffsets(_read(cu))
    key, version = id(cu), _version(cu)
    kept = _HOST.get(key)
    if kept is not None and version is not None and kept[0]() is cu and kept[1] == version:
        return kept[2]
    view = HostOffsets(_read(cu))
    if version is not None:
        _HOST[key] = (weakref.ref(cu, lambda _, key=key: _HOST.pop(key, None)), version, view)
    return view


def host_offsets(cu: torch.Tensor) -> tuple[int, ...]:
    """cu's values as ints (host_view's read)."""
    return host_view(cu).values


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


def planned_on_device(cu: torch.Tensor) -> bool:
    """Whether the API must not read cu on the host: under CUDA graph capture, or while torch.compile traces (the
    graph holds no value of cu, and a later call, or a CUDA graph replay of reduce-overhead, brings new ones)."""
    return torch.compiler.is_compiling() or capturing(cu)


# Under torch.compile the API's Python state (declare_max_seqlen's table, keyed on the tensor object) does not
# reach the compiled graph, which runs the custom ops on whatever tensors come: the bound travels as the ops'
# max_seqlen argument instead, and the op bodies hold it here while their implementation runs.
_PLAN_BOUND: contextvars.ContextVar[int | None] = contextvars.ContextVar("flash_msa_packed_bound", default=None)


@contextlib.contextmanager
def planned_with(max_seqlen: int):
    """Within the block, the packed ops plan every pack on the device, as under capture, bounded by max_seqlen."""
    token = _PLAN_BOUND.set(int(max_seqlen))
    try:
        yield
    finally:
        _PLAN_BOUND.reset(token)


def plan_bound() -> int | None:
    """The bound planned_with set, or None (the ops then read the offsets, or under capture their declared bound)."""
    return _PLAN_BOUND.get()


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


def keys_invalid_on_device(cu: torch.Tensor, cu_k: torch.Tensor, used_k: torch.Tensor | None, total_k: int,
                           max_seqlen_k: int) -> torch.Tensor:
    """0-dim bool on the device, no host read: the separate key offsets break what
    validation.check_key_offsets and check_max_seqlen(max_seqlen_k) check on the host (cu_seqlens_k from 0 to
    total_k, non-decreasing; seqused_k non-negative and within the keys; L_q <= L_k <= max_seqlen_k)."""
    c, k = cu.long(), cu_k.long()
    bad = (k[0] != 0) | (k[-1] != total_k) | (k[1:] < k[:-1]).any()
    key_len = k[1:] - k[:-1]
    if used_k is not None:
        key_len = used_k.long()
        bad = bad | (key_len < 0).any() | (k[:-1] + key_len > total_k).any()
    return bad | (c[1:] - c[:-1] > key_len).any() | (key_len > max_seqlen_k).any()
