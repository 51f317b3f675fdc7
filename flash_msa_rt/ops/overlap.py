"""Side streams for the chunked ops: a chunk's small or memory-bound work runs beside the next chunk's big kernel.

Why. The forward and the backward run in chunks (their partial buffers are bounded), and each chunk is a chain:
plan (a sort and ~40 small torch kernels) -> the big kernel -> the memory-bound combine -> the KL pass. On one
stream the GPU idles through every chunk's small kernels and grid tails, and the combine (~32 registers a thread,
no shared memory, DRAM-bound) runs alone although it fits beside a sparse_fwd CTA (128 registers a thread, 128 KB:
half the SM's registers are free). Forked streams let it, with events carrying each chunk's dependencies.

Rules that keep this safe (the caching allocator reuses a freed block in its own stream's order only):
- every stream is forked from the caller's current stream on entry and joined back into it on exit, so the
  caller sees one stream, and a CUDA-graph capture follows the fork into every side stream;
- a tensor used on a stream other than the one that allocated it stays referenced until the join (callers keep
  such tensors in lists for the whole call, never rebinding the only reference inside the loop).
"""

from __future__ import annotations

import torch

# Roles: "plan" (every chunk's plan, enqueued ahead of the kernels that read it) and "post" (the chunk's work after
# its big kernel; high priority, so its CTAs take SMs as the next big kernel's retire).
_PRIORITY = {"plan": 0, "post": -1}
_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The process's side stream of this role on device (created once: streams are not freed)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, role)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=index, priority=_PRIORITY[role])
    return _STREAMS[key]


class Forked:
    """`with Forked(device, "plan", "post") as f:` f.main is the caller's stream, f.stream(role) a side stream that
    has waited for everything enqueued on f.main before entry; on exit f.main waits for every side stream."""

    def __init__(self, device: torch.device, *roles: str):
        self.main = torch.cuda.current_stream(device)
        self.streams = {role: side_stream(device, role) for role in roles}

    def __enter__(self) -> "Forked":
        for s in self.streams.values():
            s.wait_stream(self.main)
        return self

    def __exit__(self, *exc) -> None:
        for s in self.streams.values():
            self.main.wait_stream(s)

    def stream(self, role: str) -> torch.cuda.Stream:
        return self.streams[role]

    @staticmethod
    def mark(stream: torch.cuda.Stream) -> torch.cuda.Event:
        """An event recorded on stream now (another stream waits on it for the work enqueued so far)."""
        event = torch.cuda.Event()
        event.record(stream)
        return event
