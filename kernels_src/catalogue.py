"""The kernel catalogue: every op family and the variant matrix build_tools compiles.

Enumerating the catalogue never imports cutlass; only compiling a variant does.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
from typing import Iterable, Sequence

from kernels_src.spec import ARCHS, DEFAULT_ARCHS, DEFAULT_SETS, SETS, BuildSpec

# One module per op family. Each provides: configs(**choices) -> list of configs (its whole matrix when a choice
# is None), can_implement(config, arch) -> (ok, reason), build_spec(config, arch) -> BuildSpec, and
# build_set(config, arch) -> one of SETS (kernels_src.spec: default, hopper_sync_check, opt_in).
FAMILIES: tuple[str, ...] = (
    "kernels_src.block_scores", "kernels_src.select", "kernels_src.sparse_fwd", "kernels_src.sparse_kl",
    "kernels_src.sparse_combine", "kernels_src.sparse_bwd", "kernels_src.sparse_bwd_proxy", "kernels_src.bwd_delta",
    "kernels_src.warmup_kl", "kernels_src.warmup_bwd_proxy", "kernels_src.sparse_combine_kl", "kernels_src.slot_sum",
    "kernels_src.plan_lists", "kernels_src.fp8_quant", "kernels_src.grad_cast",
)


class CatalogueError(ValueError):
    pass


def families():
    return [importlib.import_module(m) for m in FAMILIES]


def parse_sets(text: str | Iterable[str]) -> tuple[str, ...]:
    """Build set names from "default,opt_in"-style text or a list; "all" stands for every set."""
    names = [t.strip() for t in text.replace(";", ",").split(",")] if isinstance(text, str) else list(text)
    out: list[str] = []
    for name in filter(None, names):
        expanded = SETS if name == "all" else (name,)
        for n in expanded:
            if n not in SETS:
                raise CatalogueError(f"build set {n!r} is not one of {', '.join(SETS)} (or 'all')")
            if n not in out:
                out.append(n)
    if not out:
        raise CatalogueError(f"no build set named in {text!r}; sets: {', '.join(SETS)} (or 'all')")
    return tuple(out)


def variants(
    archs: Sequence[str] = DEFAULT_ARCHS,
    *,
    sets: str | Iterable[str] = DEFAULT_SETS,
    only: Iterable[str] | None = None,
    head_dims: Sequence[int] | None = None,
    block_sizes: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
) -> list[BuildSpec]:
    """The build specs for archs in the build sets named (default: the default build), restricted by --only glob
    patterns and explicit config choices.

    Config choices widen or narrow the matrix (a variant's set follows from its other fields); a choice that no
    family can implement is an error that says why, rather than an empty build (one that the sets or patterns
    leave out gives an empty list).
    """
    wanted = parse_sets(sets)
    for arch in archs:
        if arch not in ARCHS:
            raise CatalogueError(f"arch {arch!r} is not supported; supported: {', '.join(ARCHS)}")
    patterns = list(only or [])
    specs, refusals, implementable = [], [], False
    for fam in families():
        for cfg in fam.configs(head_dims=head_dims, block_sizes=block_sizes, dtypes=dtypes):
            for arch in archs:
                ok, reason = fam.can_implement(cfg, arch)
                if not ok:
                    refusals.append(f"{fam.__name__.rsplit('.', 1)[-1]} {cfg} on {arch}: {reason}")
                    continue
                implementable = True
                build_set = fam.build_set(cfg, arch)
                if build_set not in wanted:
                    continue
                spec = dataclasses.replace(fam.build_spec(cfg, arch), build_set=build_set)
                if patterns and not any(fnmatch.fnmatchcase(spec.name, p) for p in patterns):
                    continue
                specs.append(spec)
    if not implementable and (head_dims or block_sizes or dtypes):
        raise CatalogueError("no variant can implement the requested config:\n  " + "\n  ".join(refusals))
    names = [s.name for s in specs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise CatalogueError(f"variant names are not unique: {sorted(dupes)}")
    return sorted(specs, key=lambda s: s.name)
