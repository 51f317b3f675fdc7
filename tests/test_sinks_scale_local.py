"""Issue 58's options against the float64 oracle (tests/oracle.py): attention sinks, a proxy scale of its own and
more than one forced local block, on the public API (CPU: the reference backend under the runtime's sink steps),
on the reference itself, and the defaults giving today's results bit for bit.

The loss is <out, dO> + COEF * kl_loss as in test_api_oracle; d sinks is checked like every other gradient.
"""

from __future__ import annotations

import oracle
import pytest
import torch
from test_api_oracle import COEF, FACTOR, NAMES, Case, bshd, masters, random_indices, user_tensor

import flash_msa_rt.reference as ref
from flash_msa_rt import api
from flash_msa_rt.ops import library

CASES = [
    Case(2, 13, 4, 2, 2, 1, 8, 4, 4, 3),                                       # G = 2, 4 blocks, partial
    Case(1, 17, 8, 8, 2, 2, 8, 8, 4, 4, layout="bshd"),                        # G = 4, 5 blocks
    Case(1, 17, 8, 8, 2, 2, 8, 8, 4, 4, dtype=torch.bfloat16, contiguous=True),
]


def _sinks(H: int, seed: int) -> torch.Tensor:
    """float32 sink logits around the scores' scale, one strongly dominant (the 0 / 0 the KL must avoid)."""
    s = torch.randn(H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
    s[0] = 30.0
    return s


def _api_run(fn, c, m, dO, sinks, **kw):
    leaves = {n: user_tensor(t, c) for n, t in m.items()}
    sink_leaf = sinks.clone().requires_grad_(True)
    out, kl = fn(*leaves.values(), c.K * c.Bs, layout=c.layout, block_size=c.Bs, sinks=sink_leaf, **kw)
    B, S = out.shape[:2]
    (out * dO.reshape(B, S, -1).to(c.dtype)).sum().backward(retain_graph=True)
    (COEF * kl).backward()
    grads = {n: bshd(t.grad, c) for n, t in leaves.items()}
    grads["sinks"] = sink_leaf.grad
    return out.view(B, S, c.H, c.D), kl, grads


def _oracle(sparse, c, m, dO, dtype, sinks, block_indices=None, **kw):
    args = [t.to(dtype) for t in m.values()]
    up = torch.tensor(COEF, dtype=dtype)
    if sparse:
        return oracle.msa(*args, c.K, c.Bs, c.D ** -0.5, grad_out=dO.to(dtype), kl_upstream=up,
                          block_indices=block_indices, sinks=sinks, **kw)
    kw.pop("local_blocks", None)
    return oracle.warmup(*args, c.D ** -0.5, grad_out=dO.to(dtype), kl_upstream=up, sinks=sinks, **kw)


# With sinks a 16-bit out is rounded twice (the backend's out0, then out0 * (1 - p_sink): flash_msa_rt.ops.sinks),
# and the backward's delta = <dO, out> reads it: one rounding more than test_api_oracle's rule allows for.
SINK_FACTOR = {torch.float32: FACTOR, torch.bfloat16: FACTOR + 2}


def _sink_baseline(want, dO, sinks, dtype, base):
    """What a 16-bit out costs d sinks: the oracle's formula on its out rounded to dtype (the backward's delta
    reads the rounded out); the float32 oracle's d sinks for float32."""
    if dtype == torch.float32:
        return base
    delta = (dO.double() * want.out.to(dtype).double()).sum(-1).transpose(1, 2)
    return -(torch.exp(sinks.double().view(1, -1, 1) - want.lse) * delta).sum((0, 2))


def _check_sinks(got, want, dO, sinks, dtype, base):
    oracle.check("dsinks", got, want.grads["sinks"], torch.float32, _sink_baseline(want, dO, sinks, dtype, base),
                 factor=SINK_FACTOR[dtype], rounds_to_dtype=False)


def _check(c, out, kl, grads, want, base, dO, sinks):
    f = SINK_FACTOR[c.dtype]
    oracle.check("out", out, want.out, c.dtype, base.out, factor=f)
    oracle.check("kl_loss", kl, want.kl_loss, torch.float32, base.kl_loss, factor=FACTOR)
    for n in NAMES:
        oracle.check(f"d{n}", grads[n], want.grads[n], c.dtype, base.grads[n], factor=f)
    _check_sinks(grads["sinks"], want, dO, sinks, c.dtype, base.grads["sinks"])


@pytest.mark.parametrize("c", CASES, ids=str)
def test_flash_msa_func_with_all_three_matches_oracle(c):
    m, dO = masters(c, seed=58)
    sinks = _sinks(c.H, 1)
    kw = dict(proxy_scale=1.0, local_blocks=2)
    want = _oracle(True, c, m, dO, torch.float64, sinks, **kw)
    out, kl, grads = _api_run(api.flash_msa_func, c, m, dO, sinks, **kw)
    _check(c, out, kl, grads, want, _oracle(True, c, m, dO, torch.float32, sinks, want.block_indices, **kw), dO,
           sinks)


@pytest.mark.parametrize("c", CASES[::2], ids=str)
def test_flash_msa_warmup_func_with_sinks_and_proxy_scale_matches_oracle(c):
    m, dO = masters(c, seed=59)
    sinks = _sinks(c.H, 2)
    kw = dict(proxy_scale=0.7)
    want = _oracle(False, c, m, dO, torch.float64, sinks, **kw)
    out, kl, grads = _api_run(api.flash_msa_warmup_func, c, m, dO, sinks, local_blocks=3, **kw)
    _check(c, out, kl, grads, want, _oracle(False, c, m, dO, torch.float32, sinks, **kw), dO, sinks)


@pytest.mark.parametrize("kl_value", ["exact", "deferred"])
def test_the_kl_target_ignores_the_sink(kl_value):
    """A dominant sink (p_sink ~ 1) leaves the KL and the proxy gradients those of the sink-free call: tau comes
    from lse0, never from P / (1 - p_sink)."""
    c = CASES[0]
    m, dO = masters(c, seed=60)
    ins = [user_tensor(t, c) for t in m.values()]
    metric = torch.zeros(())
    _, kl0 = api.flash_msa_func(*ins, c.K * c.Bs, layout=c.layout, block_size=c.Bs)
    kl0.backward()
    g0 = [t.grad.clone() for t in ins[:2]]
    ins = [user_tensor(t, c) for t in m.values()]
    _, kl = api.flash_msa_func(*ins, c.K * c.Bs, layout=c.layout, block_size=c.Bs, kl_value=kl_value,
                               kl_metric=metric, sinks=torch.full((c.H,), 80.0))
    kl.backward()
    torch.testing.assert_close(metric, kl0.detach(), rtol=1e-6, atol=0)
    for g, want in zip((t.grad for t in ins[:2]), g0):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_select_blocks_local_blocks_matches_oracle(L):
    c = Case(2, 23, 4, 2, 2, 1, 8, 4, 4, 4)
    m, _ = masters(c, seed=61 + L)
    sel = api.select_blocks(user_tensor(m["q_proxy"], c), user_tensor(m["k_proxy"], c), c.K * c.Bs,
                            block_size=c.Bs, local_blocks=L, proxy_scale=3.0)
    want = oracle.select(m["q_proxy"], m["k_proxy"], c.K, c.Bs, 3.0, local_blocks=L)
    assert torch.equal(sel.long(), want)
    local = torch.arange(c.S) // c.Bs
    for back in range(L):  # every forced block present (where it exists)
        forced = (local - back).view(1, 1, -1, 1)
        assert ((sel == forced).any(-1) | (forced.squeeze(-1) < 0)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_sparse_attention_with_sinks_matches_oracle(dtype):
    c = Case(2, 15, 4, 2, 1, 1, 8, 4, 4, 3, dtype=dtype)
    m, dO = masters(c, seed=62)
    idx = random_indices(c.B, 2, c.S, c.K, c.Bs, torch.Generator().manual_seed(63))
    sinks = _sinks(c.H, 3)
    leaves = {n: user_tensor(m[n], c) for n in ("q", "k", "v")}
    sink_leaf = sinks.clone().requires_grad_(True)
    out, lse = api.block_sparse_attention(*leaves.values(), idx, c.Bs, return_lse=True, sinks=sink_leaf)
    (bshd(out, c) * dO.to(dtype)).sum().backward()
    qkv = [m[n] for n in ("q", "k", "v")]
    want = oracle.block_sparse(*qkv, idx, c.Bs, c.D ** -0.5, grad_out=dO, sinks=sinks)
    base = oracle.block_sparse(*(t.float() for t in qkv), idx, c.Bs, c.D ** -0.5, grad_out=dO.float(), sinks=sinks)
    oracle.check("out", bshd(out, c), want.out, dtype, base.out, factor=SINK_FACTOR[dtype])
    oracle.check("lse", lse, want.lse, torch.float32, base.lse, factor=FACTOR)
    for n in ("q", "k", "v"):
        oracle.check(f"d{n}", bshd(leaves[n].grad, c), want.grads[n], dtype, base.grads[n], factor=SINK_FACTOR[dtype])
    _check_sinks(sink_leaf.grad, want, dO, sinks, dtype, base.grads["sinks"])
    # the row with no allowed key (random_indices empties it): out 0, lse = the sink
    heads = c.H // 2
    assert not bshd(out, c)[0, c.S // 2, :heads].any()
    assert torch.equal(lse[0, :heads, c.S // 2], sinks[:heads])


def test_reference_msa_with_sinks_matches_oracle():
    """flash_msa_rt.reference itself (sinks inside its softmax, tau from lse0 recomputed) against the oracle."""
    c = CASES[0]
    m, dO = masters(c, seed=64)
    sinks = _sinks(c.H, 4)
    want = _oracle(True, c, m, dO, torch.float64, sinks, proxy_scale=1.5, local_blocks=2)
    args = list(m.values())
    idx = ref.select_blocks(args[0], args[1], c.K, c.Bs, 1.5, local_blocks=2)
    assert torch.equal(idx.long(), want.block_indices)
    out, lse, lse_proxy, kl_rows = ref.msa_forward(*args, idx, c.Bs, c.D ** -0.5, proxy_scale=1.5, sinks=sinks)
    torch.testing.assert_close(out, want.out)
    torch.testing.assert_close(lse, want.lse)
    torch.testing.assert_close(kl_rows, want.kl_rows)
    w = torch.tensor(COEF / kl_rows.numel(), dtype=torch.float64)
    grads = ref.msa_backward(*args, out, lse, lse_proxy, idx, c.Bs, c.D ** -0.5, dO, w, proxy_scale=1.5, sinks=sinks)
    for n, g in zip((*NAMES, "sinks"), grads):
        torch.testing.assert_close(g.double(), want.grads[n].double(), rtol=1e-6, atol=1e-9)


def test_varlen_with_sinks_is_the_fixed_length_call():
    c = Case(1, 13, 4, 2, 2, 1, 8, 4, 4, 3)
    m, dO = masters(c, seed=65)
    sinks = _sinks(c.H, 5)
    want = _api_run(api.flash_msa_func, c, m, dO, sinks, proxy_scale=2.0, local_blocks=2)
    leaves = [t.float()[0].clone().requires_grad_(True) for t in m.values()]
    sink_leaf = sinks.clone().requires_grad_(True)
    cu = torch.tensor([0, c.S], dtype=torch.int32)
    out, kl = api.flash_msa_varlen_func(*leaves, cu, c.S, c.K * c.Bs, block_size=c.Bs, sinks=sink_leaf,
                                        proxy_scale=2.0, local_blocks=2)
    (out * dO[0].float()).sum().backward(retain_graph=True)
    (COEF * kl).backward()
    torch.testing.assert_close(out, want[0][0])
    torch.testing.assert_close(kl, want[1])
    for n, t in zip(NAMES, leaves):
        torch.testing.assert_close(t.grad, want[2][n][0])
    torch.testing.assert_close(sink_leaf.grad, want[2]["sinks"])


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "warmup"])
def test_defaults_give_todays_results_bit_for_bit(sparse):
    c = CASES[2]
    m, dO = masters(c, seed=66)
    fn = api.flash_msa_func if sparse else api.flash_msa_warmup_func

    def run(**kw):
        leaves = [user_tensor(t, c) for t in m.values()]
        out, kl = fn(*leaves, c.K * c.Bs, layout=c.layout, block_size=c.Bs, **kw)
        (out.float() * dO.reshape(*out.shape).float()).sum().add(COEF * kl).backward()
        return [out, kl, *(t.grad for t in leaves)]

    today = run()
    for got in (run(sinks=None, proxy_scale=c.D ** -0.5, local_blocks=1), run(proxy_scale=None)):
        for a, b in zip(got, today):
            assert torch.equal(a, b)


def test_opcheck_with_sinks_and_proxy_scale():
    from torch.library import opcheck

    c = Case(1, 9, 4, 2, 2, 1, 8, 8, 4, 2)
    m, dO = masters(c, seed=67)
    qp, kp, q, k, v = (t.float().requires_grad_(True) for t in m.values())
    sinks = _sinks(c.H, 6).requires_grad_(True)
    idx = torch.ops.flash_msa.select_blocks(qp.detach(), kp.detach(), 2, 4, 0.3, None, None, None, "bf16", 2)
    opcheck(torch.ops.flash_msa.select_blocks.default, (qp.detach(), kp.detach(), 2, 4, 0.3, None, None, None,
                                                        "bf16", 2))
    opcheck(torch.ops.flash_msa.msa_forward.default,
            (qp, kp, q, k, v, idx, 4, 0.3, None, None, None, True, None, sinks, 0.5))
    opcheck(torch.ops.flash_msa.warmup_forward.default,
            (qp, kp, q, k, v, 0.3, None, None, None, True, None, sinks, 0.5))
    opcheck(torch.ops.flash_msa.block_sparse_forward.default, (q, k, v, idx, 4, 0.3, None, sinks))
    out, lse, lse_proxy, _ = library.msa_forward(qp, kp, q, k, v, idx, 4, 0.3, sinks=sinks, proxy_scale=0.5)
    saved = [t.detach() for t in (qp, kp, q, k, v, out, lse, lse_proxy)]
    opcheck(torch.ops.flash_msa.msa_backward.default,
            (*saved, idx, 4, 0.3, dO.float(), torch.tensor(0.1), None, None, None, sinks.detach(), 0.5))
