"""Which dispatch backend ran an op: a self-test check fails when the reference ran where a kernel should have."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def resolved_backends():
    """{op: {backend name}} of every dispatch resolution inside the block (the library ops look up
    dispatch.implementation at call time; an empty record means nothing was dispatched, which fails a check)."""
    from flash_msa_rt.ops import dispatch

    seen: dict[str, set[str]] = {}
    original = dispatch.implementation

    def recording(op, device, dtype, **config):
        impl = original(op, device, dtype, **config)
        name = next((b.name for b in dispatch.backends() if b.ops.get(op) is impl), "unknown")
        seen.setdefault(op, set()).add(name)
        return impl

    dispatch.implementation = recording
    try:
        yield seen
    finally:
        dispatch.implementation = original


def on_kernels(seen: dict[str, set[str]], ops: tuple[str, ...]) -> str | None:
    """None when every op resolved to a kernel backend only, else what ran instead."""
    for op in ops:
        names = seen.get(op)
        if not names:
            return f"{op} was never dispatched"
        if "reference" in names:
            return f"{op} ran on the pure-PyTorch reference, not a kernel"
    return None


def backend_text(seen: dict[str, set[str]], ops: tuple[str, ...]) -> str:
    return ",".join(sorted({n for op in ops for n in seen.get(op, ())})) or "none"
