"""The public MSA API against the dense float64 oracle (tests/oracle.py): values, kl_loss and all five gradients.

Inputs are drawn once in float64 and rounded to the test dtype, so the oracle sees exactly what the API sees.
Tolerance (oracle.check): |api - oracle64| <= FACTOR * err + atol, err the larger of the float32 oracle's error and
the rounding of the exact result to the output dtype, i.e. what the input dtype costs; atol 1e-6 of the magnitude.
The reference computes in float32 in another order (chunked rows, explicit backward formulas), and for bf16 its
backward reads the bf16-rounded `out` (D = rowsum(dO * O)), as the kernels will: FACTOR covers both.
The loss is <out, dO> + 0.3 * kl_loss, so the KL gradient is checked with a coefficient other than 1.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import oracle
import pytest
import torch

from flash_msa_rt import api

COEF = 0.3
FACTOR = 3.0
NAMES = ("q_proxy", "k_proxy", "q", "k", "v")


@dataclass(frozen=True)
class Case:
    B: int
    S: int
    H: int
    Hk: int
    Hp: int
    Hpk: int
    D: int
    Dp: int
    Bs: int
    K: int
    layout: str = "bhsd"
    dtype: torch.dtype = torch.float32
    contiguous: bool = False  # bhsd tensors as transposed views of (B, S, heads, D) storage, or contiguous

    def __str__(self):
        return (f"B{self.B}S{self.S}H{self.H}Hk{self.Hk}Hp{self.Hp}Hpk{self.Hpk}D{self.D}Bs{self.Bs}K{self.K}-"
                f"{self.layout}{'c' if self.contiguous else ''}-{str(self.dtype)[6:]}")


CASES = [
    Case(2, 13, 4, 2, 2, 1, 8, 4, 4, 2),                                      # G=2, Hp=Hk, transposed views
    Case(1, 11, 8, 1, 1, 1, 8, 8, 4, 3, layout="bshd"),                       # G=8, Hp=Hk=1
    Case(1, 10, 16, 4, 1, 1, 4, 4, 2, 1),                                     # G=16, Hp<Hk, K=1 (local only)
    Case(2, 10, 4, 1, 4, 2, 8, 4, 4, 5, contiguous=True),                     # G=1, Hp>Hk, K > 3 blocks
    Case(1, 17, 8, 8, 2, 2, 8, 8, 8, 2, layout="bshd"),                       # G=4, Hp<Hk, partial block
    Case(2, 13, 4, 2, 2, 1, 8, 4, 4, 2, dtype=torch.bfloat16),
    Case(1, 17, 8, 8, 2, 2, 8, 8, 8, 2, dtype=torch.bfloat16, contiguous=True),
]


def _rounded(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64)


def masters(c: Case, seed: int, S_total: int | None = None):
    """float64 (B, S, heads, D) tensors exactly representable in c.dtype, and dO (B, S, H, D)."""
    gen = torch.Generator().manual_seed(seed)
    B, S = c.B, S_total or c.S
    heads = {"q_proxy": (c.Hp, c.Dp), "k_proxy": (c.Hpk, c.Dp), "q": (c.H, c.D), "k": (c.Hk, c.D), "v": (c.Hk, c.D)}
    m = {n: _rounded((B, S, h, d), c.dtype, gen) for n, (h, d) in heads.items()}
    return m, _rounded((B, S, c.H, c.D), c.dtype, gen)


def user_tensor(m: torch.Tensor, c: Case) -> torch.Tensor:
    t = m.to(c.dtype)
    if c.layout == "bhsd":
        t = t.transpose(1, 2)
        if c.contiguous:
            t = t.contiguous()
    return t.detach().requires_grad_(True)


def bshd(t: torch.Tensor, c: Case) -> torch.Tensor:
    return t.transpose(1, 2) if c.layout == "bhsd" else t


def run_api(fn, c: Case, m: dict, dO: torch.Tensor, **kw):
    """out (B, S, H, D), kl_loss and the five gradients (B, S, heads, D) of <out, dO> + COEF * kl_loss."""
    leaves = {n: user_tensor(t, c) for n, t in m.items()}
    out, kl = fn(*leaves.values(), c.K * c.Bs, layout=c.layout, block_size=c.Bs, **kw)
    B, S = out.shape[:2]
    assert out.dtype == c.dtype and kl.dtype == torch.float32 and kl.dim() == 0
    assert out.shape == (B, S, c.H * c.D)
    (out * dO.reshape(B, S, -1).to(c.dtype)).sum().backward(retain_graph=True)
    (COEF * kl).backward()
    return out.view(B, S, c.H, c.D), kl, {n: bshd(t.grad, c) for n, t in leaves.items()}


def run_oracle(sparse: bool, c: Case, m: dict, dO, dtype, block_indices):
    args = [t.to(dtype) for t in m.values()]
    scale = c.D ** -0.5
    if sparse:
        return oracle.msa(*args, c.K, c.Bs, scale, grad_out=dO.to(dtype), kl_upstream=torch.tensor(COEF, dtype=dtype),
                          block_indices=block_indices)
    return oracle.warmup(*args, scale, grad_out=dO.to(dtype), kl_upstream=torch.tensor(COEF, dtype=dtype))


def check_against_oracle(c: Case, out, kl, grads, want, base):
    """want: float64 oracle; base: float32 oracle. Values, KL and gradients within the rule of the module doc."""
    oracle.check("out", out, want.out, c.dtype, base.out, factor=FACTOR)
    oracle.check("kl_loss", kl, want.kl_loss, torch.float32, base.kl_loss, factor=FACTOR)
    for n in NAMES:
        oracle.check(f"d{n}", grads[n], want.grads[n], c.dtype, base.grads[n], factor=FACTOR)


@pytest.mark.parametrize("c", CASES, ids=str)
def test_flash_msa_func_matches_oracle(c):
    m, dO = masters(c, seed=zlib.crc32(str(c).encode()))
    sel = api.select_blocks(*(user_tensor(m[n], c) for n in ("q_proxy", "k_proxy")), c.K * c.Bs,
                            scale=c.D ** -0.5, layout=c.layout, block_size=c.Bs)
    want = run_oracle(True, c, m, dO, torch.float64, None)
    # Selection: the API's blocks are the oracle's (random data: no near ties at these seeds).
    assert sel.dtype == torch.int32 and sel.shape == (c.B, c.Hp, c.S, c.K)
    assert torch.equal(sel.long(), want.block_indices), "select_blocks differs from the oracle's selection"
    out, kl, grads = run_api(api.flash_msa_func, c, m, dO)
    check_against_oracle(c, out, kl, grads, want, run_oracle(True, c, m, dO, torch.float32, want.block_indices))


@pytest.mark.parametrize("c", [CASES[0], CASES[3], CASES[6]], ids=str)
def test_flash_msa_warmup_func_matches_oracle(c):
    m, dO = masters(c, seed=7)
    out, kl, grads = run_api(api.flash_msa_warmup_func, c, m, dO)
    check_against_oracle(c, out, kl, grads, run_oracle(False, c, m, dO, torch.float64, None),
                         run_oracle(False, c, m, dO, torch.float32, None))


def test_warmup_alias_is_published_name():
    assert api.flash_msa_func_warmup is api.flash_msa_warmup_func


# --- varlen ------------------------------------------------------------------------------------------------------

def oracle_varlen(sparse, c: Case, m: dict, dO, cu: list[int], dtype):
    """The oracle per packed sequence of (1, total, ...) tensors; KL normalised by Hp * total."""
    total = cu[-1]
    outs, kl_sum, grads = [], 0.0, {n: [] for n in NAMES}
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        seg = {n: t[:, a:b].to(dtype) for n, t in m.items()}
        w = torch.full((1, c.Hp, b - a), COEF / (c.Hp * total), dtype=dtype)
        if sparse:
            r = oracle.msa(*seg.values(), c.K, c.Bs, c.D ** -0.5, grad_out=dO[:, a:b].to(dtype), kl_upstream=w)
        else:
            r = oracle.warmup(*seg.values(), c.D ** -0.5, grad_out=dO[:, a:b].to(dtype), kl_upstream=w)
        outs.append(r.out)
        kl_sum = kl_sum + r.kl_rows.sum()
        for n in NAMES:
            grads[n].append(r.grads[n])
    return oracle.Result(out=torch.cat(outs, 1), kl_loss=kl_sum / (c.Hp * total),
                         grads={n: torch.cat(g, 1) for n, g in grads.items()})


def _flat(t):
    return t.reshape(1, -1, *t.shape[2:])


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "warmup"])
def test_cu_seqlens_keyword_matches_oracle_per_sequence(sparse):
    """flash_msa_func(cu_seqlens=...) over B * S flattened tokens: each segment an independent sequence."""
    c = Case(2, 9, 4, 2, 2, 1, 8, 4, 2, 2)
    cu = [0, 4, 9, 9, 16, 18]  # an empty sequence, odd lengths, both row boundaries
    m, dO = masters(c, seed=11)
    fn = api.flash_msa_func if sparse else api.flash_msa_warmup_func
    out, kl, grads = run_api(fn, c, m, dO, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    flat = {n: _flat(t) for n, t in m.items()}
    want = oracle_varlen(sparse, c, flat, _flat(dO), cu, torch.float64)
    base = oracle_varlen(sparse, c, flat, _flat(dO), cu, torch.float32)
    check_against_oracle(c, _flat(out), kl, {n: _flat(g) for n, g in grads.items()}, want, base)


def test_document_list_equals_cu_seqlens():
    """Runs of equal ids (and row starts) delimit sequences: the same result as the equivalent cu_seqlens."""
    c = Case(2, 9, 4, 2, 2, 1, 8, 4, 2, 2)
    docs = torch.tensor([[3, 3, 3, 3, 1, 1, 1, 1, 1], [1, 1, 2, 2, 2, 2, 2, 5, 5]])  # row 1 continues id 1: new seq
    cu = [0, 4, 9, 11, 16, 18]
    m, dO = masters(c, seed=12)
    out_d, kl_d, g_d = run_api(api.flash_msa_func, c, m, dO, document_list=docs)
    out_c, kl_c, g_c = run_api(api.flash_msa_func, c, m, dO, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert torch.equal(out_d, out_c) and torch.equal(kl_d, kl_c)
    for n in NAMES:
        assert torch.equal(g_d[n], g_c[n]), n
    flat = {n: _flat(t) for n, t in m.items()}
    want = oracle_varlen(True, c, flat, _flat(dO), cu, torch.float64)
    base = oracle_varlen(True, c, flat, _flat(dO), cu, torch.float32)
    check_against_oracle(c, _flat(out_d), kl_d, {n: _flat(g) for n, g in g_d.items()}, want, base)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "warmup"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen_func_matches_oracle(sparse, dtype):
    """flash_msa_varlen_func on (total, heads, D) tensors with unequal lengths and an empty sequence."""
    c = Case(1, 20, 8, 2, 4, 2, 8, 4, 2, 3, layout="bshd", dtype=dtype)
    cu = [0, 5, 5, 12, 20]
    m, dO = masters(c, seed=13)
    leaves = {n: t[0].to(dtype).requires_grad_(True) for n, t in m.items()}
    fn = api.flash_msa_varlen_func if sparse else api.flash_msa_warmup_varlen_func
    out, kl = fn(*leaves.values(), torch.tensor(cu, dtype=torch.int32), 8, c.K * c.Bs, block_size=c.Bs)
    assert out.shape == (20, c.H, c.D) and out.dtype == dtype
    (out * dO[0].to(dtype)).sum().backward(retain_graph=True)
    (COEF * kl).backward()
    want = oracle_varlen(sparse, c, m, dO, cu, torch.float64)
    base = oracle_varlen(sparse, c, m, dO, cu, torch.float32)
    check_against_oracle(c, out[None], kl, {n: t.grad[None] for n, t in leaves.items()}, want, base)


# --- kl_loss: value, metric, gradient scaling ----------------------------------------------------------------------

def test_kl_metric_receives_the_kl_value():
    c = CASES[0]
    m, _ = masters(c, seed=3)
    metric = torch.full((), -1.0)
    _, kl = api.flash_msa_func(*(user_tensor(t, c) for t in m.values()), c.K * c.Bs, block_size=c.Bs,
                               kl_metric=metric)
    assert metric.item() == kl.item() and kl.item() > 0


def test_kl_gradient_reaches_the_proxy_only_and_scales_with_its_coefficient():
    c = CASES[0]
    m, _ = masters(c, seed=4)
    grads = {}
    for coef in (0.3, 1.2):
        leaves = [user_tensor(t, c) for t in m.values()]
        _, kl = api.flash_msa_func(*leaves, c.K * c.Bs, block_size=c.Bs)
        (coef * kl).backward()
        grads[coef] = [t.grad for t in leaves]
    for n, g03, g12 in zip(NAMES, grads[0.3], grads[1.2]):
        if n.endswith("proxy"):
            assert g03.abs().max() > 0, n
            torch.testing.assert_close(g12, 4 * g03, rtol=1e-6, atol=0)
        else:
            assert g03 is None or not g03.any(), f"{n} got a gradient from kl_loss"


def test_out_gradient_does_not_reach_the_proxy():
    """Selection is discrete: <out, dO> alone trains q, k, v and leaves the proxy at zero."""
    c = CASES[0]
    m, dO = masters(c, seed=5)
    leaves = [user_tensor(t, c) for t in m.values()]
    out, _ = api.flash_msa_func(*leaves, c.K * c.Bs, block_size=c.Bs)
    (out * dO.reshape(c.B, c.S, -1)).sum().backward()
    assert all(t.grad is None or not t.grad.any() for t in leaves[:2])
    assert all(t.grad.abs().max() > 0 for t in leaves[2:])


# --- block_sparse_attention ---------------------------------------------------------------------------------------

def random_indices(B, Hi, S, K, Bs, gen):
    """Random (B, Hi, S, K) int32 rows: earlier and later blocks, duplicates, -1 slots, and one all-empty row."""
    nb = -(-S // Bs)
    idx = torch.randint(-1, nb, (B, Hi, S, K), generator=gen, dtype=torch.int32)
    idx[0, 0, S // 2] = -1  # no allowed key: out 0, lse -inf
    idx[-1, -1, -1, :2] = idx[-1, -1, -1, 0]  # a duplicate
    return idx


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("Hi", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_sparse_attention_matches_oracle(layout, Hi, dtype):
    c = Case(2, 15, 4, 2, 1, 1, 8, 4, 4, 3, layout=layout, dtype=dtype)
    gen = torch.Generator().manual_seed(21 + Hi)
    m, dO = masters(c, seed=22 + Hi)
    idx = random_indices(c.B, Hi, c.S, c.K, c.Bs, gen)
    leaves = {n: user_tensor(m[n], c) for n in ("q", "k", "v")}
    out, lse = api.block_sparse_attention(*leaves.values(), idx, c.Bs, layout=layout, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (c.B, c.H, c.S) and not lse.requires_grad
    assert out.shape == leaves["q"].shape and out.dtype == dtype
    (bshd(out, c) * dO.to(dtype)).sum().backward()
    want = oracle.block_sparse(*(m[n] for n in ("q", "k", "v")), idx, c.Bs, c.D ** -0.5, grad_out=dO)
    base = oracle.block_sparse(*(m[n].float() for n in ("q", "k", "v")), idx, c.Bs, c.D ** -0.5, grad_out=dO.float())
    oracle.check("out", bshd(out, c), want.out, dtype, base.out, factor=FACTOR)
    oracle.check("lse", lse, want.lse, torch.float32, base.lse, factor=FACTOR)
    for n in ("q", "k", "v"):
        oracle.check(f"d{n}", bshd(leaves[n].grad, c), want.grads[n], dtype, base.grads[n], factor=FACTOR)
    empty_row = bshd(out, c)[0, c.S // 2, : c.H // Hi]
    assert not empty_row.any() and torch.isinf(lse[0, : c.H // Hi, c.S // 2]).all()


def test_block_sparse_attention_default_scale_and_return():
    c = Case(1, 9, 2, 1, 1, 1, 16, 4, 4, 2)
    m, _ = masters(c, seed=30)
    idx = random_indices(1, 1, c.S, 2, 4, torch.Generator().manual_seed(31))
    q, k, v = (m[n].float().transpose(1, 2) for n in ("q", "k", "v"))
    out = api.block_sparse_attention(q, k, v, idx, 4)
    want = oracle.block_sparse(m["q"], m["k"], m["v"], idx, 4, 16 ** -0.5)
    torch.testing.assert_close(out.transpose(1, 2).double(), want.out, rtol=1e-5, atol=1e-6)
    out2 = api.block_sparse_attention(q, k, v, idx, 4, scale=0.5)
    assert not torch.allclose(out, out2)
