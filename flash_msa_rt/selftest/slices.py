"""The guard's slices: per op family, one small problem of the self-test run on a backend's op implementations and
compared with flash_msa_rt.reference in float64 under flash_msa_rt.tolerances (flash_msa_rt.guard runs them on first
use of a family on an arch whose cubins never ran on hardware).

A slice calls the backend's ops directly (the functions dispatch would hand out), not the public API: the guard runs
while dispatch resolves an op, inside the torch.library op's implementation, below autograd and possibly on an
autograd thread, so it must neither need autograd nor dispatch again. The forward's outputs feed the backward, as in
training. Each slice returns its comparisons; one that fails names what failed.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch

from flash_msa_rt import tolerances
from flash_msa_rt.selftest.problems import (BLOCK, D, Problem, _deterministic, _inputs, block_sparse_comparisons,
                                            block_sparse_indices, check_plan, selection_comparison)

# S = 300: three key blocks of 128, the last partial (five of 64); G = H / Hp = 4 (the default config's);
# Hp = Hk = 2; K = 2.
SLICE_PROBLEM = Problem(1, 300, 8, 2, 2, 1, 2)


@dataclass(frozen=True)
class Shape:
    """The head dims and key block a slice runs at: the cubins a family launches differ by them (sm90a's D 256
    kernels, a proxy of Dp 64, blocks of 64), so each one a process uses proves itself. Written into the guard's
    unit name after the family and dtype, except at the default D 128 / Dp 128 / Bs 128 (units named before shapes
    existed keep their names, and their passes on disk stay valid)."""

    D: int = D
    Dp: int = D
    Bs: int = BLOCK

    def suffix(self) -> str:
        return "" if self == Shape() else f"/D{self.D}-Dp{self.Dp}-Bs{self.Bs}"

    @classmethod
    def parse(cls, suffix: str) -> "Shape":
        """The inverse of suffix(): "" or "D64-Dp64-Bs64"."""
        if not suffix:
            return cls()
        try:
            d, dp, bs = suffix.split("-")
            assert d[0] == "D" and dp[:2] == "Dp" and bs[:2] == "Bs"
            return cls(int(d[1:]), int(dp[2:]), int(bs[2:]))
        except (ValueError, AssertionError, IndexError):
            raise ValueError(f"slice shape {suffix!r}: expected D<d>-Dp<dp>-Bs<bs>, e.g. D64-Dp64-Bs64") from None


def problem_for(dtype: torch.dtype, shape: Shape = Shape()) -> Problem:
    return replace(SLICE_PROBLEM, dtype=dtype, D=shape.D, Bs=shape.Bs, proxy_dim=shape.Dp)


def _scale(p: Problem) -> float:
    return p.D ** -0.5


def select_slice(ops: Mapping[str, Callable], dtype: torch.dtype, device,
                 shape: Shape = Shape()) -> list[tolerances.Comparison]:
    """select_blocks: the contract's selection against the float64 block scores (near ties within eps)."""
    from flash_msa_rt import reference

    p = problem_for(dtype, shape)
    x, _, _ = _inputs(p, device, seed=11)
    sel = ops["select_blocks"](x["q_proxy"], x["k_proxy"], p.K, p.Bs, _scale(p), None)
    scores = reference.proxy_block_scores(x["q_proxy"].double(), x["k_proxy"].double(), p.Bs, _scale(p)).double()
    eps = tolerances.selection_epsilon(x["q_proxy"], x["k_proxy"], _scale(p))
    return [selection_comparison(sel.to(torch.int32), scores, p.K, eps, p.Bs)]


def _kl_weights(p: Problem, device) -> torch.Tensor:
    return torch.ones((p.B, p.Hp, p.S), dtype=torch.float32, device=device)


def _proxied(ops, fwd: str, bwd: str, ref_fwd, ref_bwd, sel_args: tuple, p: Problem, device,
             repeat_deterministic: bool = False) -> list[tolerances.Comparison]:
    """msa or warmup: forward (out, kl_rows), then the backward on the forward's own out / lse / lse_proxy; the KL
    pass alone (kl_value "deferred"'s backward) on the forward's lse gives the same kl_rows."""
    x, dout, _ = _inputs(p, device, seed=12)
    ins = list(x.values())
    kl_grad = _kl_weights(p, device)
    scale = _scale(p)
    out, lse, lse_p, kl_rows = ops[fwd](*ins, *sel_args, scale, None)
    # what the torch.library op saves for its backward (flash_msa_rt.ops.library._stats)
    out, lse, lse_p = out.contiguous(), lse.float().contiguous(), lse_p.float().contiguous()
    kl_alone = ops[fwd.replace("forward", "kl")](*ins[:4], ins[4], lse, *sel_args, scale, None)[1]
    if repeat_deterministic:
        with _deterministic():
            grads = ops[bwd](*ins, out, lse, lse_p, *sel_args, scale, dout, kl_grad, None)
            again = ops[bwd](*ins, out, lse, lse_p, *sel_args, scale, dout, kl_grad, None)
    else:
        grads = ops[bwd](*ins, out, lse, lse_p, *sel_args, scale, dout, kl_grad, None)

    def ref(dt):
        r_ins = [t.to(dt) for t in ins]
        o, r_lse, r_lse_p, r_kl = ref_fwd(*r_ins, *sel_args, scale)
        g = ref_bwd(*r_ins, o, r_lse, r_lse_p, *sel_args, scale, dout.to(dt), kl_grad.to(dt))
        return o, r_kl.mean(), g

    want, base = ref(torch.float64), ref(torch.float32)
    comps = [tolerances.check("out", out.reshape(dout.shape), want[0], base[0]),
             tolerances.check("kl_loss", kl_rows.float().mean(), want[1], base[1]),
             tolerances.check("kl_loss (KL pass alone)", kl_alone.float().mean(), want[1], base[1])]
    comps += [tolerances.check(f"d{n}", g, w, b) for n, g, w, b in zip(x, grads, want[2], base[2])]
    if repeat_deterministic:
        same = all(torch.equal(a, b) for a, b in zip(grads, again))
        comps.append(tolerances.Comparison("bitwise repeat", 0.0 if same else float("inf"), 0.0,
                                           None if same else "two deterministic backward passes differ"))
    return comps


def _msa_selection(x: dict, p: Problem) -> torch.Tensor:
    from flash_msa_rt import reference

    return reference.select_blocks(x["q_proxy"], x["k_proxy"], p.K, p.Bs, _scale(p)).to(torch.int32).contiguous()


def msa_slice(ops: Mapping[str, Callable], dtype: torch.dtype, device, shape: Shape = Shape(),
              deterministic: bool = False) -> list[tolerances.Comparison]:
    """msa_forward and msa_backward (sparse_fwd, combine, sparse_kl, sparse_bwd, sparse_bwd_proxy) on the
    reference's selection; on CUDA also the plan kernels the sparse launchers plan with."""
    from flash_msa_rt import reference

    p = problem_for(dtype, shape)
    x, _, _ = _inputs(p, device, seed=12)  # the inputs _proxied draws (same seed)
    sel = _msa_selection(x, p)
    comps = _proxied(ops, "msa_forward", "msa_backward", reference.msa_forward, reference.msa_backward,
                     (sel, p.Bs), p, device, repeat_deterministic=deterministic)
    if torch.device(device).type == "cuda" and not deterministic:
        for row in check_plan(p, device, 13):
            if row.status == "FAIL":
                comps.append(tolerances.Comparison("plans", float("inf"), 0.0, f"plan kernels: {row.detail}"))
    return comps


def deterministic_slice(ops, dtype, device, shape: Shape = Shape()) -> list[tolerances.Comparison]:
    """msa_backward under torch.use_deterministic_algorithms: within tolerance and bitwise repeatable."""
    return msa_slice(ops, dtype, device, shape, deterministic=True)


def warmup_slice(ops: Mapping[str, Callable], dtype: torch.dtype, device,
                 shape: Shape = Shape()) -> list[tolerances.Comparison]:
    """warmup_forward and warmup_backward (cuDNN's dense main attention where used, the proxy's KL pass and
    backward kernels)."""
    from flash_msa_rt import reference

    return _proxied(ops, "warmup_forward", "warmup_backward", reference.warmup_forward, reference.warmup_backward,
                    (), problem_for(dtype, shape), device)


def block_sparse_slice(ops: Mapping[str, Callable], dtype: torch.dtype, device,
                       shape: Shape = Shape()) -> list[tolerances.Comparison]:
    """block_sparse_forward and block_sparse_backward over random indices (-1 slots, a repeat, an empty row)."""
    p = problem_for(dtype, shape)
    x, dout, g = _inputs(p, device, seed=14)
    idx = block_sparse_indices(p.B, p.Hk, p.S, p.K, g, device, p.Bs)
    q, k, v = x["q"], x["k"], x["v"]
    scale = _scale(p)
    out, lse = ops["block_sparse_forward"](q, k, v, idx, p.Bs, scale, None)
    out, lse = out.contiguous(), lse.float().contiguous()
    grads = ops["block_sparse_backward"](q, k, v, out, lse, idx, p.Bs, scale, dout, None)

    return block_sparse_comparisons(q, k, v, idx, scale, dout, out, lse, grads, p.Bs)


# family -> (its slice, the dispatch ops it proves)
SLICES: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "select": (select_slice, ("select_blocks",)),
    "msa": (msa_slice, ("msa_forward", "msa_backward")),
    "msa_deterministic": (deterministic_slice, ("msa_backward",)),
    "warmup": (warmup_slice, ("warmup_forward", "warmup_backward")),
    "block_sparse": (block_sparse_slice, ("block_sparse_forward", "block_sparse_backward")),
}
