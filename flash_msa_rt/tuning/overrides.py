"""Explicit, scoped overrides of the tuning policies (flash_msa_rt.tuning): how tests and benchmarks run a variant
or a sizing other than the one a policy picks, without patching anything.

    with tuning.override(sparse_fwd={"schedule": "lockstep", "kl_schedule": "lockstep"}, **tuning.every_mma("sync")):
        flash_msa_rt.msa(...)

An override names a policy (its module in flash_msa_rt.tuning) and fields of its frozen choice; those fields are
taken as given and the policy derives the others from them (a forced MMA gets that MMA's schedule). Overrides
nest (inner fields win) and are scoped to the with-block of the current context (a contextvars.ContextVar: per
thread and per asyncio task). The custom ops' autograd rules re-enter the overrides their forward ran under
(`applied`), since autograd runs the backward on its own device threads.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Mapping

_POLICIES: dict[str, type] = {}  # policy name -> its choice dataclass (each policy module registers itself)


def register(name: str, choice: type) -> None:
    """Declare policy `name` and the frozen dataclass its choose() returns (the fields an override may set)."""
    _POLICIES[name] = choice


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The overrides in effect: ((policy, ((field, value), ...)), ...), sorted; hashable (a cache key)."""

    items: tuple = ()

    def fields(self, policy: str) -> dict[str, Any]:
        return next((dict(f) for p, f in self.items if p == policy), {})

    def merged(self, ops: Mapping[str, Mapping[str, Any]]) -> "Overrides":
        out = {p: dict(f) for p, f in self.items}
        for policy, fields in ops.items():
            out.setdefault(policy, {}).update(fields)
        return Overrides(tuple(sorted((p, tuple(sorted(f.items()))) for p, f in out.items() if f)))


NONE = Overrides()
_active: contextvars.ContextVar[Overrides] = contextvars.ContextVar("flash_msa_tuning_overrides", default=NONE)


def _check(ops: Mapping[str, Mapping[str, Any]]) -> None:
    for policy, fields in ops.items():
        if policy not in _POLICIES:
            raise ValueError(f"tuning.override: unknown policy {policy!r}; policies: {sorted(_POLICIES)}")
        if not isinstance(fields, Mapping):
            raise TypeError(f"tuning.override: {policy}= must be a mapping of field -> value, got "
                            f"{type(fields).__name__}")
        known = {f.name for f in dataclasses.fields(_POLICIES[policy])}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"tuning.override: {policy} has no fields {unknown}; its fields: {sorted(known)}")
        for name, value in fields.items():
            try:
                hash(value)
            except TypeError:
                raise TypeError(f"tuning.override: {policy}.{name} = {value!r} must be hashable") from None


@contextlib.contextmanager
def override(**ops: Mapping[str, Any]) -> Iterator[Overrides]:
    """Within the block, each named policy takes the given fields of its choice as they are."""
    _check(ops)
    token = _active.set(_active.get().merged(ops))
    try:
        yield _active.get()
    finally:
        _active.reset(token)


@contextlib.contextmanager
def applied(overrides: Overrides) -> Iterator[Overrides]:
    """Within the block, exactly `overrides` (what current() returned elsewhere) are in effect."""
    token = _active.set(overrides)
    try:
        yield overrides
    finally:
        _active.reset(token)


def current() -> Overrides:
    return _active.get()


def given(policy: str) -> dict[str, Any]:
    """The fields of policy's choice that the current overrides set."""
    return _active.get().fields(policy)
