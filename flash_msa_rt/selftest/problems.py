"""What the self-test and the first-use guard share: the small problems, their inputs, the selection contract's
comparison and the plan kernels' check. Nothing here goes through the public API or dispatch, so the guard
(flash_msa_rt.guard), which runs while dispatch resolves an op, can use it."""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from flash_msa_rt import tolerances
from flash_msa_rt.selftest.report import Row

DETERMINISTIC_ARCHS = ("sm90a",)  # README: the deterministic backward kernels exist on sm90a only


BLOCK = 128  # the default configuration's key block and head dim
D = 128


@dataclass(frozen=True)
class Problem:
    """An MSA problem: (B, S, H, Hk, Hp, Hpk, K blocks of Bs tokens), head dim D, the proxy's Dp = min(D, 128)
    (the matrix's rule: docs/matrix.md) unless proxy_dim names another."""

    B: int
    S: int
    H: int
    Hk: int
    Hp: int
    Hpk: int
    K: int
    dtype: torch.dtype = torch.bfloat16
    D: int = D
    Bs: int = BLOCK
    proxy_dim: int | None = None  # Dp where it is not the matrix's min(D, 128) (the guard's slice of a model's Dp)

    @property
    def Dp(self) -> int:
        return self.proxy_dim or min(self.D, 128)

    def label(self) -> str:
        dt = {torch.bfloat16: "bf16", torch.float16: "f16"}[self.dtype]
        at = "" if (self.D, self.Bs) == (D, BLOCK) else f" D{self.D} Bs{self.Bs}"
        at += "" if self.proxy_dim in (None, min(self.D, 128)) else f" Dp{self.Dp}"
        return (f"{dt} B{self.B} S{self.S} H{self.H}/{self.Hk} Hp{self.Hp}/{self.Hpk} G{self.H // self.Hp} "
                f"K{self.K}{at}")
# Odd lengths (partial last blocks), every G, Hp = Hk and Hp > Hk, Hpk > 1, K past the block count.
PROBLEMS = (
    Problem(1, 700, 8, 2, 2, 1, 3),
    Problem(2, 1000, 16, 2, 4, 1, 4, torch.float16),
    Problem(1, 777, 8, 8, 8, 2, 16),
    Problem(1, 1100, 16, 2, 2, 1, 5, torch.float16),
    Problem(1, 1500, 16, 1, 1, 1, 8),
    Problem(1, 650, 16, 2, 4, 4, 2, torch.float16),
)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable):
    """(fn(), seconds) with the device's queue drained before and after."""
    _sync()
    t0 = time.perf_counter()
    result = fn()
    _sync()
    return result, time.perf_counter() - t0


def _rows(op, p, comparisons, backend, seconds, refusal=None) -> list[Row]:
    rows = []
    for c in comparisons:
        problem = c.problem if refusal is None else f"{refusal}" + (f"; {c.problem}" if c.problem else "")
        rows.append(Row(op, p.label(), c.name, backend, c.max_error, c.bound, seconds,
                        "ok" if problem is None else "FAIL", problem or ""))
    return rows


def _inputs(p: Problem, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=g).to(p.dtype)

    names = ("q_proxy", "k_proxy", "q", "k", "v")
    shapes = ((p.Hp, p.Dp), (p.Hpk, p.Dp), (p.H, p.D), (p.Hk, p.D), (p.Hk, p.D))
    return dict(zip(names, (rnd(p.B, p.S, h, d) for h, d in shapes))), rnd(p.B, p.S, p.H, p.D), g


def selection_comparison(sel: torch.Tensor, scores: torch.Tensor, K: int, eps: float,
                         block_size: int = BLOCK) -> tolerances.Comparison:
    """The contract's selection on (B, Hp, S, NB) float64 block scores: every row holds its local block, no block
    after it, no repeat, -1 only in its trailing empty slots; max_error is the largest shortfall of a kept block's
    score below the row's K-1-th best earlier score (the near-tie rule allows eps)."""
    B, Hp, S, NB = scores.shape
    name = "block_indices"
    if tuple(sel.shape) != (B, Hp, S, K):
        return tolerances.Comparison(name, float("inf"), eps, f"shape {tuple(sel.shape)} != {(B, Hp, S, K)}")
    i = torch.arange(S, device=sel.device)
    local = (i // block_size).view(1, 1, S, 1)
    s = sel.long()
    live = s >= 0
    n_live = live.sum(-1)
    want_live = torch.clamp(local.squeeze(-1), max=K - 1) + 1
    if not torch.equal(n_live, want_live.expand_as(n_live)):
        return tolerances.Comparison(name, float("inf"), eps, "a row keeps the wrong number of blocks")
    if not ((s == local) & live).any(-1).all():
        return tolerances.Comparison(name, float("inf"), eps, "a row lacks its local block")
    if ((s > local) & live).any():
        return tolerances.Comparison(name, float("inf"), eps, "a row keeps a block after its own")
    sorted_live = torch.sort(torch.where(live, s, torch.full_like(s, -1)), dim=-1).values
    if ((sorted_live[..., 1:] == sorted_live[..., :-1]) & (sorted_live[..., 1:] >= 0)).any():
        return tolerances.Comparison(name, float("inf"), eps, "a row keeps a block twice")
    earlier = scores.masked_fill(torch.arange(NB, device=sel.device).view(1, 1, 1, NB) >= local, float("-inf"))
    if K < 2:
        return tolerances.Comparison(name, 0.0, eps)
    kth = torch.sort(earlier, dim=-1, descending=True).values[..., min(K - 1, NB) - 1:min(K - 1, NB)]
    kept = live & (s != local)
    got = earlier.gather(-1, s.clamp(min=0))
    shortfall = torch.where(kept & torch.isfinite(kth), kth - got, torch.zeros_like(got)).clamp(min=0)
    err = shortfall.max().item() if shortfall.numel() else 0.0
    return tolerances.Comparison(name, err, eps, None if err <= eps else f"a kept block scores {err:.3e} below "
                                                                         f"the row's K-1-th best (eps {eps:.3e})")


@contextlib.contextmanager
def _deterministic():
    before, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def block_sparse_indices(B: int, Hi: int, S: int, K: int, g: torch.Generator, device,
                         block_size: int = BLOCK) -> torch.Tensor:
    """Random (B, Hi, S, K) int32 indices: the local block in slot 0, random earlier and later blocks, -1 slots, a
    repeat, and one row with no allowed key (out 0, lse -inf)."""
    nb = -(-S // block_size)
    idx = torch.randint(-1, nb, (B, Hi, S, K), generator=g, dtype=torch.int32, device=device)
    idx[..., 0] = (torch.arange(S, device=device, dtype=torch.int32) // block_size).view(1, 1, S)
    idx[0, 0, S // 2] = -1
    if K > 1:
        idx[-1, -1, -1, 1] = idx[-1, -1, -1, 0]
    return idx


def check_plan(p: Problem, device, seed: int) -> list[Row]:
    """The plan kernels (plan_lists, plan_items): the work plans they build equal the torch sort's, field for field."""
    from flash_msa_rt import tuning
    from flash_msa_rt.ops import sparse_plan as sp

    if p.Bs not in tuning.plan.choose("").list_block_sizes:
        return [Row("plan_lists/plan_items", p.label(), "plans", "-", None, None, 0.0, "skip",
                    f"plans at key blocks of {p.Bs} sort with torch (flash_msa_rt.tuning.plan.list_block_sizes)")]
    g = torch.Generator(device=device).manual_seed(seed)
    nb = -(-p.S // p.Bs)
    perm = torch.rand((p.B, p.Hp, p.S, nb), generator=g, device=device).argsort(dim=-1).to(torch.int32)
    idx = torch.full((p.B, p.Hp, p.S, p.K), -1, dtype=torch.int32, device=device)
    idx[..., :min(p.K, nb)] = perm[..., :p.K]
    G = p.H // p.Hp
    cuts = ((32, 64), (64, 32))
    with tuning.override(plan={"lists_on_device": True}):
        ran = sp.lists_on_device(idx, p.Bs, G, p.Hp, p.S) is not None
        got, t = _timed(lambda: sp.chunk_plans(idx, p.Bs, G, p.Hp, p.S, cuts, "list"))
    with tuning.override(plan={"lists_on_device": False}):  # torch's stable sort
        want = sp.chunk_plans(idx, p.Bs, G, p.Hp, p.S, cuts, "list")
    differ = [f"{key}.{f}" for key in want for gp, wp in zip(got.get(key, ()), want[key])
              for f in ("entry_query", "entry_dest", "items", "item_count", "list_bounds")
              if not torch.equal(getattr(gp, f), getattr(wp, f))]
    if sorted(got) != sorted(want):
        differ.append("chunk keys")
    comp = tolerances.Comparison("plans", 0.0 if not differ else float("inf"), 0.0,
                                 None if not differ else "fields differ: " + ", ".join(differ[:4]))
    return _rows("plan_lists/plan_items", p, [comp], "kernel", t,
                 None if ran else "the plan kernels were not used for this problem")


def block_sparse_comparisons(q, k, v, idx, scale: float, dout, out, lse, grads,
                             block_size: int = BLOCK) -> list[tolerances.Comparison]:
    """block_sparse_forward / _backward results (out, lse, dq, dk, dv) against the reference in float64, with the
    float32 reference as the dtype baseline."""
    from flash_msa_rt import reference

    def ref(dt):
        ins = [t.detach().to(dt) for t in (q, k, v)]
        o, r_lse = reference.block_sparse_forward(*ins, idx, block_size, scale)
        return (o, r_lse, *reference.block_sparse_backward(*ins, o, r_lse, idx, block_size, scale, dout.to(dt)))

    want, base = ref(torch.float64), ref(torch.float32)
    comps = [tolerances.check("out", out, want[0], base[0]),
             tolerances.check("lse", lse, want[1], base[1], result_dtype=torch.float32)]
    comps += [tolerances.check(f"d{n}", gr, w, b) for n, gr, w, b in zip("qkv", grads, want[2:], base[2:])]
    return comps
