"""The oracle (tests/oracle.py) that the GPU tests' tolerances come from, against torch's own causal SDPA
(torch.nn.functional.scaled_dot_product_attention, an independent implementation), in float64 on CPU: outputs,
log-sum-exps and gradients of dense causal attention (what warmup's main attention is, and what MSA is when every
causal block is selected), with GQA heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import oracle


def _sdpa(q, k, v, scale, grad_out):
    """(out, lse, (dq, dk, dv)) of causal SDPA in float64, (B, S, heads, D) layout, GQA by repeating k, v."""
    H, Hk = q.shape[2], k.shape[2]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    qq, kk, vv = (t.transpose(1, 2) for t in leaves)
    kk, vv = kk.repeat_interleave(H // Hk, 1), vv.repeat_interleave(H // Hk, 1)
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale).transpose(1, 2)
    grads = torch.autograd.grad((out * grad_out).sum(), leaves)
    s = (qq @ kk.transpose(-1, -2)) * scale  # lse is not an SDPA output on CPU: logsumexp of its causal scores
    S = q.shape[1]
    lse = torch.logsumexp(s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf")), -1)
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("B, S, H, Hk, D", [(1, 1, 1, 1, 8), (2, 37, 4, 2, 16), (1, 130, 8, 1, 32)])
def test_oracle_attention_equals_causal_sdpa(B, S, H, Hk, D):
    gen = torch.Generator().manual_seed(S + H)
    q, k, v, do = (oracle.randn(gen, (B, S, h, D), torch.float64) for h in (H, Hk, Hk, H))
    scale = D ** -0.5
    want_out, want_lse, want_grads = _sdpa(q, k, v, scale, do)
    causal = torch.ones(S, S, dtype=torch.bool).tril().view(1, 1, S, S)
    out, lse, _ = oracle.attention(q, k, v, causal, scale)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    qp, kp = oracle.randn(gen, (B, S, 1, D), torch.float64), oracle.randn(gen, (B, S, 1, D), torch.float64)
    for res in (oracle.warmup(qp, kp, q, k, v, scale, grad_out=do),
                # MSA with every causal block selected is dense causal attention
                oracle.msa(qp, kp, q, k, v, -(-S // 16), 16, scale, grad_out=do)):
        torch.testing.assert_close(res.out, want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res.lse, want_lse, rtol=1e-12, atol=1e-12)
        for name, g in zip("qkv", want_grads):
            torch.testing.assert_close(res.grads[name], g, rtol=1e-10, atol=1e-12)


def test_oracle_is_not_sdpa_when_blocks_are_left_out():
    """The comparison above can fail: dropping one causal block moves the oracle away from SDPA."""
    B, S, H, D, Bs = 1, 64, 2, 16, 16
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (oracle.randn(gen, (B, S, H, D), torch.float64) for _ in range(4))
    qp = kp = oracle.randn(gen, (B, S, 1, D), torch.float64)
    want_out, _, _ = _sdpa(q, k, v, D ** -0.5, do)
    res = oracle.msa(qp, kp, q, k, v, S // Bs - 1, Bs, D ** -0.5, grad_out=do)  # the last rows lose one block
    assert (res.out - want_out).abs().max() > 1e-3


@pytest.mark.parametrize("sparse", [False, True])
def test_oracle_rows_equal_the_whole_oracle(sparse):
    """oracle.rows (the long-sequence tests' exact values on sampled rows) equals the whole oracle on those rows."""
    B, S, H, Hk, Hp, Hpk, D, Bs, K = 2, 150, 4, 2, 2, 1, 16, 32, 3
    gen = torch.Generator().manual_seed(9)
    qp, kp, q, k, v = (oracle.randn(gen, (B, S, h, D), torch.float64) for h in (Hp, Hpk, H, Hk, Hk))
    scale = D ** -0.5
    whole = oracle.msa(qp, kp, q, k, v, K, Bs, scale) if sparse else oracle.warmup(qp, kp, q, k, v, scale)
    picked = [0, 31, 32, 100, 149]
    part = oracle.rows(qp, kp, q, k, v, picked, scale, whole.block_indices if sparse else None, Bs)
    torch.testing.assert_close(part.out, whole.out[:, picked], rtol=1e-12, atol=1e-12)
    for name in ("lse", "lse_proxy", "kl_rows"):
        torch.testing.assert_close(getattr(part, name), getattr(whole, name)[..., picked], rtol=1e-10, atol=1e-12)
