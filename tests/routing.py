"""What ran: the GPU tests' guard against a silent fallback to the pure-PyTorch reference (issue 40).

A GPU test whose op falls back to the reference compares the reference with itself. So in GPU tests the fallback
is an error (tests/conftest.py turns dispatch's fallback warning into an exception and checks dispatch's record at
teardown) unless the test carries `@pytest.mark.allow_reference` or runs the fallback inside allowed_reference().

dispatch's record: every (op, device type, ...) it resolved since the last dispatch.reset_warnings() (the autouse
fixture calls it before each test), with the implementation it chose.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Iterator

# dispatch._warn_reference_on_cuda's message, as a warnings-filter regex (no ':' : pytest's filter syntax splits
# on it, hence '.' for the one after "flash_msa").
FALLBACK_MESSAGE = r"flash_msa. .* runs on the slow pure-PyTorch reference"
FALLBACK_FILTER = f"error:{FALLBACK_MESSAGE}:RuntimeWarning"


def resolved_on_cuda() -> dict[str, list[str]]:
    """op -> the names of the implementations dispatch chose for it on CUDA devices since its last reset."""
    from flash_msa_rt.ops import backends

    out: dict[str, list[str]] = {}
    for key, impl in list(backends._resolved.items()):
        op, device_type = key[0], key[1]
        if device_type == "cuda":
            name = "reference" if impl is backends.reference_impl(op) else f"{impl.__module__}.{impl.__qualname__}"
            out.setdefault(op, []).append(name)
    return out


def reference_fallbacks() -> list[str]:
    """The ops dispatch resolved to the reference on a CUDA device since its last reset."""
    return sorted(op for op, names in resolved_on_cuda().items() if "reference" in names)


def assert_ran_on_kernels(ops: Iterable[str]) -> None:
    """Every op in ops was resolved on CUDA since the last reset, and never to the reference."""
    seen = resolved_on_cuda()
    missing = sorted(set(ops) - set(seen))
    assert not missing, f"ops never dispatched on CUDA: {missing} (dispatched: {seen})"
    fallen = reference_fallbacks()
    assert not fallen, f"ops that ran on the pure-PyTorch reference instead of the kernels: {fallen} ({seen})"


@contextlib.contextmanager
def allowed_reference() -> Iterator[None]:
    """Within the block a CUDA op may run on the reference (what the test asks for); afterwards dispatch forgets
    the decisions made here, so the teardown check sees only what ran outside."""
    from flash_msa_rt.ops import dispatch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FALLBACK_MESSAGE, category=RuntimeWarning)
        try:
            yield
        finally:
            dispatch.reset_warnings()
