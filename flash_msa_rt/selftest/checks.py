"""The self-test's checks: one function per op family, each running small random problems through the public API
(or the family's launcher) and comparing every result with flash_msa_rt.reference in float64."""

from __future__ import annotations

import torch

from flash_msa_rt import tolerances
from flash_msa_rt.selftest.backends import backend_text as _backend_text
from flash_msa_rt.selftest.backends import on_kernels, resolved_backends
from flash_msa_rt.selftest.problems import (  # noqa: F401 - PROBLEMS and check_plan: the self-test's table
    BLOCK, PROBLEMS, Problem, _deterministic, _inputs, _rows, _timed, block_sparse_comparisons,
    block_sparse_indices, check_plan, selection_comparison)
from flash_msa_rt.selftest.report import Row


def check_select(p: Problem, device, seed: int) -> list[Row]:
    """select (the proxy's top-K blocks): layout, local block, and the near-tie rule against the float64 scores."""
    from flash_msa_rt import api, reference

    x, _, _ = _inputs(p, device, seed)
    scale = p.D ** -0.5
    with resolved_backends() as seen:
        sel, t = _timed(lambda: api.select_blocks(x["q_proxy"], x["k_proxy"], p.K * p.Bs, scale, layout="bshd",
                                                  block_size=p.Bs))
    scores = reference.proxy_block_scores(x["q_proxy"].double(), x["k_proxy"].double(), p.Bs, scale).double()
    return _rows("select", p, [selection_comparison(sel, scores, p.K, tolerances.selection_epsilon(
        x["q_proxy"], x["k_proxy"], scale), p.Bs)], _backend_text(seen, ("select_blocks",)), t,
                 on_kernels(seen, ("select_blocks",)))


def check_msa(p: Problem, device, seed: int, deterministic: bool = False) -> list[Row]:
    """flash_msa_func forward and backward: out (sparse_fwd + combine), kl_loss (sparse_kl), dq, dk, dv
    (sparse_bwd), dq_proxy, dk_proxy (sparse_bwd_proxy); deterministic: the same backward under
    torch.use_deterministic_algorithms, twice, bitwise equal."""
    from flash_msa_rt import api, reference

    x, dout, _ = _inputs(p, device, seed)
    scale = p.D ** -0.5
    sel = api.select_blocks(x["q_proxy"], x["k_proxy"], p.K * p.Bs, scale, layout="bshd", block_size=p.Bs)
    kl_coef = float(p.B * p.Hp * p.S)  # d loss / d KL_p(i) = 1 for every row
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    with resolved_backends() as seen:
        (out, kl), t_fwd = _timed(lambda: api.flash_msa_func(*leaves.values(), p.K * p.Bs, scale, layout="bshd",
                                                                 block_size=p.Bs))
        loss = (out.reshape(dout.shape).float() * dout.float()).sum() + kl_coef * kl
        if deterministic:
            with _deterministic():
                grads, t_bwd = _timed(lambda: torch.autograd.grad(loss, list(leaves.values()), retain_graph=True))
                again = torch.autograd.grad(loss, list(leaves.values()))
        else:
            grads, t_bwd = _timed(lambda: torch.autograd.grad(loss, list(leaves.values())))

    def ref(dt):
        ins = [t.to(dt) for t in x.values()]
        o, lse, lse_p, kl_rows = reference.msa_forward(*ins, sel, p.Bs, scale)
        g = reference.msa_backward(*ins, o, lse, lse_p, sel, p.Bs, scale, dout.to(dt),
                                   torch.ones((), dtype=dt, device=device))
        return o, kl_rows.mean(), dict(zip(x, g))

    want, base = ref(torch.float64), ref(torch.float32)
    got_grads = dict(zip(x, grads))
    main_grads = [tolerances.check(f"d{n}", got_grads[n], want[2][n], base[2][n]) for n in ("q", "k", "v")]
    proxy_grads = [tolerances.check(f"d{n}", got_grads[n], want[2][n], base[2][n]) for n in ("q_proxy", "k_proxy")]
    if deterministic:
        same = all(torch.equal(a, b) for a, b in zip(grads, again))
        repeat = tolerances.Comparison("bitwise repeat", 0.0 if same else float("inf"), 0.0,
                                       None if same else "two backward passes differ")
        ops = ("msa_backward",)
        return _rows("sparse_bwd (deterministic)", p, main_grads + proxy_grads + [repeat],
                     _backend_text(seen, ops), t_bwd, on_kernels(seen, ops))
    fwd_ops, bwd_ops = ("msa_forward",), ("msa_backward",)
    return (_rows("sparse_fwd", p, [tolerances.check("out", out.reshape(dout.shape), want[0], base[0])],
                  _backend_text(seen, fwd_ops), t_fwd, on_kernels(seen, fwd_ops))
            + _rows("sparse_kl", p, [tolerances.check("kl_loss", kl, want[1], base[1])],
                    _backend_text(seen, fwd_ops), t_fwd, on_kernels(seen, fwd_ops))
            + _rows("sparse_bwd", p, main_grads, _backend_text(seen, bwd_ops), t_bwd, on_kernels(seen, bwd_ops))
            + _rows("sparse_bwd_proxy", p, proxy_grads, _backend_text(seen, bwd_ops), t_bwd,
                    on_kernels(seen, bwd_ops)))


def check_warmup(p: Problem, device, seed: int) -> list[Row]:
    """flash_msa_warmup_func: dense main attention (cuDNN), the proxy's KL pass and backward (warmup_kl,
    warmup_bwd_proxy, or the sparse kernels over every causal block)."""
    from flash_msa_rt import api, reference

    x, dout, _ = _inputs(p, device, seed)
    scale = p.D ** -0.5
    kl_coef = float(p.B * p.Hp * p.S)
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    ops = ("warmup_forward", "warmup_backward")
    with resolved_backends() as seen:
        (out, kl), t_fwd = _timed(lambda: api.flash_msa_warmup_func(*leaves.values(), p.K * p.Bs, scale,
                                                                    layout="bshd", block_size=p.Bs))
        loss = (out.reshape(dout.shape).float() * dout.float()).sum() + kl_coef * kl
        grads, t_bwd = _timed(lambda: torch.autograd.grad(loss, list(leaves.values())))

    def ref(dt):
        ins = [t.to(dt) for t in x.values()]
        o, lse, lse_p, kl_rows = reference.warmup_forward(*ins, scale)
        g = reference.warmup_backward(*ins, o, lse, lse_p, scale, dout.to(dt), torch.ones((), dtype=dt, device=device))
        return o, kl_rows.mean(), dict(zip(x, g))

    want, base = ref(torch.float64), ref(torch.float32)
    got_grads = dict(zip(x, grads))
    comps = [tolerances.check("out", out.reshape(dout.shape), want[0], base[0]),
             tolerances.check("kl_loss", kl, want[1], base[1])]
    comps += [tolerances.check(f"d{n}", got_grads[n], want[2][n], base[2][n]) for n in x]
    return _rows("warmup", p, comps, _backend_text(seen, ops), t_fwd + t_bwd, on_kernels(seen, ops))


def check_block_sparse(p: Problem, device, seed: int) -> list[Row]:
    """block_sparse_attention forward and backward (the sparse kernels without the KL pass), Hi = Hk."""
    from flash_msa_rt import api

    x, dout, g = _inputs(p, device, seed)
    idx = block_sparse_indices(p.B, p.Hk, p.S, p.K, g, device, p.Bs)
    scale = p.D ** -0.5
    leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v")]
    ops = ("block_sparse_forward", "block_sparse_backward")
    with resolved_backends() as seen:
        (out, lse), t_fwd = _timed(lambda: api.block_sparse_attention(*leaves, idx, p.Bs, scale, layout="bshd",
                                                                      return_lse=True))
        grads, t_bwd = _timed(lambda: torch.autograd.grad((out * dout).sum(), leaves))

    comps = block_sparse_comparisons(*leaves, idx, scale, dout, out, lse, grads, p.Bs)
    return _rows("block_sparse", p, comps, _backend_text(seen, ops), t_fwd + t_bwd, on_kernels(seen, ops))


def check_block_scores(p: Problem, device, seed: int) -> list[Row]:
    """proxy_block_scores (the block_scores kernel, bfloat16 only: float16 problems are skipped)."""
    from flash_msa_rt import proxy_block_scores, reference

    if p.dtype != torch.bfloat16:
        return [Row("block_scores", p.label(), "scores", "kernel", None, None, 0.0, "skip",
                    "the block_scores kernel ships for bfloat16 only")]
    x, _, _ = _inputs(p, device, seed)
    scale = p.D ** -0.5
    got, t = _timed(lambda: proxy_block_scores(x["q_proxy"], x["k_proxy"], p.Bs, scale))
    want = reference.proxy_block_scores(x["q_proxy"].double(), x["k_proxy"].double(), p.Bs, scale).double()
    base = reference.proxy_block_scores(x["q_proxy"].float(), x["k_proxy"].float(), p.Bs, scale)
    return _rows("block_scores", p, [tolerances.check("scores", got, want, base)], "kernel", t)
