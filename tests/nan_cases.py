"""Shared by the NaN propagation tests (reference on CPU, kernels on the GPU): where a NaN goes into an input, and
which results must then be NaN, found on the dense float64 oracle by dependence (a result depends on an input
element when changing that element by +1 changes it; the oracle's masked keys contribute an exact 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MSA_RESULTS = ("out", "lse", "lse_proxy", "kl_rows", "dq_proxy", "dk_proxy", "dq", "dk", "dv")


@dataclass(frozen=True)
class Case:
    """A NaN in input `name` at token `index`, head `head`: one element (dim 3) or the whole head vector."""

    name: str
    index: int
    head: int
    whole: bool

    @property
    def id(self) -> str:
        role = "row" if self.name in ("q", "q_proxy") else "key"
        return f"{self.name}-{role}{self.index}-h{self.head}-{'vector' if self.whole else 'element'}"

    def where(self, t: torch.Tensor):
        return (slice(None), self.index, self.head, slice(None) if self.whole else 3)


# One query row for q and q_proxy, one key for k, k_proxy and v (token 17: inside a block, not its first key).
CASES = tuple(Case(name, 17, head, whole) for name, head in (("q_proxy", 1), ("k_proxy", 0), ("q", 3), ("k", 1),
                                                             ("v", 1)) for whole in (False, True))


def perturbed(x: dict, case: Case, by: float = 1.0) -> dict:
    out = dict(x)
    t = x[case.name].clone()
    t[case.where(t)] += by
    out[case.name] = t
    return out


def poisoned(x: dict, case: Case) -> dict:
    out = dict(x)
    t = x[case.name].clone()
    t[case.where(t)] = float("nan")
    out[case.name] = t
    return out


def dependents(clean: dict, changed: dict) -> dict:
    """{result: bool mask of the elements that differ between the clean and the perturbed oracle run}."""
    return {name: (clean[name] != changed[name]).to(clean[name].device) for name in clean}
