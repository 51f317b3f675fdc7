"""Separate query and key lengths on the varlen entry points (cu_seqlens_k, max_seqlen_k, seqused_k).

Against a brute-force dense float64 oracle written here (tests/oracle.py style: full L_q x L_k matrices, selection
by a Python sort of (-score, block), gradients by autograd): each sequence's queries are the last L_q of its L_k
positions. Then the properties context parallelism builds on: a chunk of queries against its whole key prefix gives
the full call's rows (out, KL rows), the gradients summed over chunks are the full call's, and one rank's two zigzag
chunks read one gathered key tensor through seqused_k. Last, the validation messages.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from flash_msa_rt import api
from flash_msa_rt.reference.attention import chunked_by

H, Hk, Hp, Hpk, D, Dp, BS, K = 4, 2, 2, 1, 8, 4, 4, 2
SCALE = D ** -0.5
COEF = 0.3
NAMES = ("q_proxy", "k_proxy", "q", "k", "v")
ENTRY = {"sparse": api.flash_msa_varlen_func, "warmup": api.flash_msa_warmup_varlen_func}

# (L_q, L_k) per sequence: L_q < L_k with L_q not a multiple of BS, partial last key blocks, an empty query
# sequence with keys, a length-1 sequence, one with L_q == L_k, one with a single query after many keys.
LENGTHS = [(5, 11), (0, 6), (1, 1), (7, 7), (1, 13), (3, 9)]


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def leaves(total_q, total_k, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proxy": (total_q, Hp, Dp), "k_proxy": (total_k, Hpk, Dp), "q": (total_q, H, D),
              "k": (total_k, Hk, D), "v": (total_k, Hk, D)}
    x = {n: torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True) for n, s in shapes.items()}
    return x, torch.randn(total_q, H, D, generator=g, dtype=torch.float64).to(dtype)


# --- the dense oracle --------------------------------------------------------------------------------------------

def oracle_select(sp, L_q, L_k):
    """(Hp, L_q, K) blocks of each query at position L_k - L_q + i: its local block and the K - 1 best earlier."""
    nb = -(-L_k // BS)
    pos = torch.arange(L_k - L_q, L_k)
    causal = torch.arange(L_k).view(1, -1) <= pos.view(-1, 1)
    s = F.pad(sp.masked_fill(~causal, float("-inf")), (0, nb * BS - L_k), value=float("-inf"))
    c = s.view(Hp, L_q, nb, BS).amax(-1).tolist()
    sel = torch.full((Hp, L_q, K), -1, dtype=torch.long)
    for p in range(Hp):
        for i in range(L_q):
            local = int(pos[i]) // BS
            best = sorted(range(local), key=lambda j: (-c[p][i][j], j))[:K - 1]
            chosen = sorted([local, *best])
            sel[p, i, :len(chosen)] = torch.tensor(chosen)
    return sel


def oracle_sequence(qp, kp, q, k, v, sparse):
    """out (L_q, H, D), kl_rows (Hp, L_q), selection of one sequence, differentiable in the five inputs."""
    L_q, L_k = q.shape[0], k.shape[0]
    pos = torch.arange(L_k - L_q, L_k)
    allowed = (torch.arange(L_k).view(1, -1) <= pos.view(-1, 1)).expand(Hp, L_q, L_k)
    sp = torch.einsum("ipd,tpd->pit", qp, kp.repeat_interleave(Hp // Hpk, 1)) * SCALE
    sel = None
    if sparse:
        sel = oracle_select(sp.detach(), L_q, L_k)
        blk = torch.arange(L_k) // BS
        allowed = allowed & (sel.unsqueeze(-1) == blk).any(-2)
    s = torch.einsum("ihd,thd->hit", q, k.repeat_interleave(H // Hk, 1)) * SCALE
    mask = allowed.repeat_interleave(H // Hp, 0)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    out = torch.einsum("hit,thd->ihd", p, v.repeat_interleave(H // Hk, 1))
    tau = p.detach().view(Hp, H // Hp, L_q, L_k).mean(1)
    log_pi = torch.log_softmax(sp.masked_fill(~allowed, float("-inf")), -1)
    terms = tau * (torch.log(torch.where(tau > 0, tau, 1)) - torch.where(allowed, log_pi, 0))
    return out, torch.where(tau > 0, terms, 0).sum(-1), sel


def oracle_pack(x, q_spans, k_spans, sparse, grad_out):
    """out, kl_loss (mean over (p, query token) of the pack) and the five gradients of <out, dO> + COEF kl_loss."""
    leaves_ = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    total_q = x["q"].shape[0]
    out = torch.zeros(total_q, H, D, dtype=torch.float64)
    kl_sum = torch.zeros((), dtype=torch.float64)
    for (a, b), (ka, kb) in zip(q_spans, k_spans):
        if b == a:
            continue
        o, kl_rows, _ = oracle_sequence(leaves_["q_proxy"][a:b], leaves_["k_proxy"][ka:kb], leaves_["q"][a:b],
                                        leaves_["k"][ka:kb], leaves_["v"][ka:kb], sparse)
        out = torch.index_put(out, (torch.arange(a, b),), o)
        kl_sum = kl_sum + kl_rows.sum()
    kl_loss = kl_sum / (Hp * total_q)
    grads = torch.autograd.grad((out * grad_out).sum() + COEF * kl_loss, list(leaves_.values()), allow_unused=True)
    grads = {n: g if g is not None else torch.zeros_like(leaves_[n]) for n, g in zip(NAMES, grads)}
    return out.detach(), kl_loss.detach(), grads


def spans(cu):
    cu = cu.tolist()
    return list(zip(cu[:-1], cu[1:]))


def api_call(kind, x, grad_out, cu_q, max_q, **keys):
    """out, kl_loss and the five gradients of <out, dO> + COEF kl_loss through the public entry point."""
    out, kl_loss = ENTRY[kind](*(x[n] for n in NAMES), cu_q, max_q, K * BS, SCALE, block_size=BS, **keys)
    grads = torch.autograd.grad((out * grad_out).sum() + COEF * kl_loss, [x[n] for n in NAMES])
    return out.detach(), kl_loss.detach(), dict(zip(NAMES, grads))


def assert_close(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    bound = 1e-10 * max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


# --- against the oracle ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sparse", "warmup"])
@pytest.mark.parametrize("chunk", [None, 64], ids=["one_chunk", "row_chunks"])
def test_separate_lengths_match_the_dense_oracle(kind, chunk):
    cu_q, cu_k = offsets([a for a, _ in LENGTHS]), offsets([b for _, b in LENGTHS])
    x, grad_out = leaves(int(cu_q[-1]), int(cu_k[-1]), seed=1)
    # row_chunks: a budget of 64 scores makes the reference take its query rows one or two at a time
    with chunked_by(chunk) if chunk else contextlib.nullcontext():
        got = api_call(kind, x, grad_out, cu_q, max(a for a, _ in LENGTHS), cu_seqlens_k=cu_k,
                       max_seqlen_k=max(b for _, b in LENGTHS))
    want = oracle_pack(x, spans(cu_q), spans(cu_k), kind == "sparse", grad_out)
    assert_close("out", got[0], want[0])
    assert_close("kl_loss", got[1], want[1])
    for n in NAMES:
        assert_close(f"d{n}", got[2][n], want[2][n])
    assert want[2]["k"][int(cu_k[1]):int(cu_k[2])].abs().max() == 0  # the empty query sequence's keys: no gradient


def test_selection_counts_blocks_from_each_sequence_key_start():
    cu_q, cu_k = offsets([a for a, _ in LENGTHS]), offsets([b for _, b in LENGTHS])
    x, _ = leaves(int(cu_q[-1]), int(cu_k[-1]), seed=2)
    qp, kp = x["q_proxy"].detach().unsqueeze(0), x["k_proxy"].detach().unsqueeze(0)
    got = torch.ops.flash_msa.select_blocks(qp, kp, K, BS, SCALE, cu_q, cu_k)
    assert got.shape == (1, Hp, int(cu_q[-1]), K)
    for (a, b), (ka, kb) in zip(spans(cu_q), spans(cu_k)):
        if b > a:
            sp = torch.einsum("ipd,tpd->pit", x["q_proxy"][a:b].detach(),
                              x["k_proxy"][ka:kb].detach().repeat_interleave(Hp // Hpk, 1)) * SCALE
            assert torch.equal(got[0, :, a:b].long(), oracle_select(sp, b - a, kb - ka)), (a, b, ka, kb)


@pytest.mark.parametrize("kind", ["sparse", "warmup"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_lengths_are_todays_call_bitwise(kind, dtype):
    lengths = [11, 0, 1, 8, 5]
    cu = offsets(lengths)
    x, grad_out = leaves(int(cu[-1]), int(cu[-1]), seed=3, dtype=dtype)
    plain = api_call(kind, x, grad_out, cu, max(lengths))
    separate = api_call(kind, x, grad_out, cu, max(lengths), cu_seqlens_k=cu.clone(), max_seqlen_k=max(lengths))
    assert torch.equal(plain[0], separate[0]) and torch.equal(plain[1], separate[1])
    for n in NAMES:
        assert torch.equal(plain[2][n], separate[2][n]), n


# --- chunks of queries against their whole key prefix --------------------------------------------------------

def ops_rows(kind, x, cu_q, **keys):
    """(out, kl_rows (Hp, total_q), selection (Hp, total_q, K) or None) from the torch.library ops (kl_rows: the
    per-row KL the API averages)."""
    t = [x[n].detach().unsqueeze(0) for n in NAMES]
    cu_k, used = keys.get("cu_seqlens_k"), keys.get("seqused_k")
    if kind == "sparse":
        idx = torch.ops.flash_msa.select_blocks(t[0], t[1], K, BS, SCALE, cu_q, cu_k, used)
        out, _, _, kl_rows = torch.ops.flash_msa.msa_forward(*t, idx, BS, SCALE, cu_q, cu_k, used)
        return out[0], kl_rows[0], idx[0]
    out, _, _, kl_rows = torch.ops.flash_msa.warmup_forward(*t, SCALE, cu_q, cu_k, used)
    return out[0], kl_rows[0], None


def chunk_call(kind, x, grad_out, lengths, c0, c1, use_seqused_k):
    """Queries [c0, c1) of every sequence (clipped to its length) against that sequence's key prefix [0, c1):
    either the prefixes copied into one key tensor (cu_seqlens_k) or the full key tensor read through seqused_k.
    -> (query rows in the full pack, out, (out, kl_rows, selection) of the ops, gradients scaled to the full
    call's kl normalisation)."""
    starts = offsets(lengths).tolist()
    rows = torch.cat([torch.arange(s + min(c0, n), s + min(c1, n)) for s, n in zip(starts, lengths)])
    q_len = [max(0, min(c1, n) - c0) for n in lengths]
    k_len = [min(c1, n) for n in lengths]
    cu_q = offsets(q_len)
    xq = {n: x[n].detach()[rows].requires_grad_(True) for n in ("q_proxy", "q")}
    if use_seqused_k:
        xk = {n: x[n].detach().clone().requires_grad_(True) for n in ("k_proxy", "k", "v")}
        keys = dict(cu_seqlens_k=offsets(lengths), seqused_k=torch.tensor(k_len, dtype=torch.int32))
        k_rows = torch.arange(x["k"].shape[0])
    else:
        k_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, k_len)])
        xk = {n: x[n].detach()[k_rows].requires_grad_(True) for n in ("k_proxy", "k", "v")}
        keys = dict(cu_seqlens_k=offsets(k_len))
    xc = {**xq, **xk}
    rows_of_ops = ops_rows(kind, xc, cu_q, **keys)
    # kl_loss of the chunk divides by Hp * its query tokens; rescaled, the chunks' losses add up to the full call's.
    out, kl_loss = ENTRY[kind](*(xc[n] for n in NAMES), cu_q, max(q_len), K * BS, SCALE, block_size=BS,
                               max_seqlen_k=max(k_len), **keys)
    loss = (out * grad_out[rows]).sum() + COEF * kl_loss * (len(rows) / x["q"].shape[0])
    grads = torch.autograd.grad(loss, [xc[n] for n in NAMES])
    full = {}
    for n, g in zip(NAMES, grads):
        full[n] = torch.zeros_like(x[n].detach()).index_add_(0, rows if n in xq else k_rows, g)
    return rows, out.detach(), rows_of_ops, full


@pytest.mark.parametrize("kind", ["sparse", "warmup"])
@pytest.mark.parametrize("use_seqused_k", [False, True], ids=["cu_seqlens_k", "seqused_k"])
def test_query_chunks_reproduce_the_full_call(kind, use_seqused_k):
    lengths = [13, 1, 0, 9, 6]
    cu = offsets(lengths)
    x, grad_out = leaves(int(cu[-1]), int(cu[-1]), seed=4)
    full_out, _, full_grads = api_call(kind, x, grad_out, cu, max(lengths))
    full_out_r, full_kl_r, full_idx = ops_rows(kind, x, cu)
    assert torch.equal(full_out, full_out_r)
    summed = {n: torch.zeros_like(x[n].detach()) for n in NAMES}
    seen = torch.zeros(int(cu[-1]), dtype=torch.long)
    for c0, c1 in ((0, 3), (3, 5), (5, 10), (10, 13)):  # chunk edges off the block grid, a last partial chunk
        rows, out, (out_r, kl_r, idx), grads = chunk_call(kind, x, grad_out, lengths, c0, c1, use_seqused_k)
        seen[rows] += 1
        assert torch.equal(out, out_r)
        if idx is not None:  # the same blocks, counted from the same sequence start
            assert torch.equal(idx, full_idx[:, rows])
        # Equal to float64 rounding, not bitwise: the reference scores each row chunk against its own key prefix
        # width, so the reductions run in another order (observed <= 1e-15).
        assert_close(f"out[{c0}:{c1}]", out, full_out[rows])
        assert_close(f"kl_rows[{c0}:{c1}]", kl_r, full_kl_r[:, rows])
        for n in NAMES:
            summed[n] += grads[n]
    assert torch.equal(seen, torch.ones_like(seen))  # the chunks tile the queries
    for n in NAMES:
        assert_close(f"sum of chunk d{n}", summed[n], full_grads[n])


@pytest.mark.parametrize("kind", ["sparse", "warmup"])
def test_zigzag_chunks_share_one_gathered_key_tensor(kind):
    """Context parallelism over 2 ranks, 4 chunks of c tokens: rank r holds chunks r and 3 - r of each sequence and
    all-gathers the keys; its two chunks are two query sequences over overlapping key prefixes of that one tensor
    (cu_seqlens_k repeats each sequence start, seqused_k gives the prefixes): no key is copied."""
    c, n_seq = 5, 2  # two sequences of 4 * 5 tokens: chunk edges off the block grid
    L = 4 * c
    cu = offsets([L] * n_seq)
    x, grad_out = leaves(n_seq * L, n_seq * L, seed=5)
    full_out, full_kl, full_grads = api_call(kind, x, grad_out, cu, L)
    _, full_kl_r, full_idx = ops_rows(kind, x, cu)
    summed = {n: torch.zeros_like(x[n].detach()) for n in NAMES}
    kl_total = torch.zeros((), dtype=torch.float64)
    for r in range(2):
        chunks = [r, 3 - r]
        rows = torch.cat([torch.arange(s * L + j * c, s * L + (j + 1) * c) for s in range(n_seq) for j in chunks])
        cu_q = offsets([c] * (2 * n_seq))
        cu_k = torch.tensor([0] + [s * L for s in range(n_seq) for _ in chunks][1:] + [n_seq * L], dtype=torch.int32)
        used = torch.tensor([(j + 1) * c for _ in range(n_seq) for j in chunks], dtype=torch.int32)
        xr = {n: x[n].detach()[rows].requires_grad_(True) for n in ("q_proxy", "q")}
        xr.update({n: x[n].detach().clone().requires_grad_(True) for n in ("k_proxy", "k", "v")})
        keys = dict(cu_seqlens_k=cu_k, seqused_k=used)
        out, kl_loss = ENTRY[kind](*(xr[n] for n in NAMES), cu_q, c, K * BS, SCALE, block_size=BS, max_seqlen_k=L,
                                   **keys)
        assert_close(f"rank {r} out", out.detach(), full_out[rows])
        _, kl_r, idx = ops_rows(kind, xr, cu_q, **keys)
        assert_close(f"rank {r} kl_rows", kl_r, full_kl_r[:, rows])
        if idx is not None:
            assert torch.equal(idx, full_idx[:, rows])
        kl_total += kl_loss.detach() * len(rows)
        loss = (out * grad_out[rows]).sum() + COEF * kl_loss * (len(rows) / (n_seq * L))
        for n, g in zip(NAMES, torch.autograd.grad(loss, [xr[n] for n in NAMES])):
            summed[n] += torch.zeros_like(summed[n]).index_add_(0, rows, g) if n in ("q_proxy", "q") else g
    assert_close("kl_loss over ranks", kl_total / (n_seq * L), full_kl)
    for n in NAMES:
        assert_close(f"sum over ranks of d{n}", summed[n], full_grads[n])


# --- validation --------------------------------------------------------------------------------------------------

def _call(**over):
    cu_q, cu_k = offsets([3, 2]), offsets([4, 6])
    x, _ = leaves(5, 10, seed=6, dtype=torch.float32)
    args = {**{n: x[n].detach() for n in NAMES}, "cu_seqlens": cu_q, "max_seqlen": 3, "cu_seqlens_k": cu_k,
            "max_seqlen_k": 6}
    args.update(over)
    pos = [args.pop(n) for n in (*NAMES, "cu_seqlens", "max_seqlen")]
    return api.flash_msa_varlen_func(*pos, K * BS, block_size=BS, **args)


def test_valid_call_runs():
    out, kl_loss = _call()
    assert out.shape == (5, H, D) and torch.isfinite(out).all() and torch.isfinite(kl_loss)


@pytest.mark.parametrize("over, error, words", [
    (dict(cu_seqlens_k=[0, 4, 10]), TypeError, ["cu_seqlens_k", "list"]),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 10])), TypeError, ["cu_seqlens_k", "int32", "int64"]),
    (dict(cu_seqlens_k=torch.zeros(1, 3, dtype=torch.int32)), ValueError, ["cu_seqlens_k", "1-D"]),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")), ValueError,
     ["cu_seqlens_k", "meta"]),
    (dict(cu_seqlens_k=offsets([4, 3, 3])), ValueError, ["cu_seqlens_k", "4 entries", "cu_seqlens has 3"]),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32)), ValueError, ["cu_seqlens_k", "end", "10"]),
    (dict(cu_seqlens_k=torch.tensor([0, 7, 3, 10], dtype=torch.int32), cu_seqlens=offsets([3, 0, 2])), ValueError,
     ["cu_seqlens_k", "non-decreasing"]),
    (dict(cu_seqlens_k=offsets([2, 8])), ValueError, ["sequence 0", "L_q=3", "L_k=2", "L_q <= L_k"]),
    (dict(max_seqlen_k=None), ValueError, ["max_seqlen_k", "None", "cu_seqlens_k"]),
    (dict(max_seqlen_k=5), ValueError, ["max_seqlen_k=5", "longest", "6"]),
    (dict(max_seqlen_k=-1), ValueError, ["max_seqlen_k", "-1", "non-negative"]),
    (dict(cu_seqlens_k=None), ValueError, ["max_seqlen_k", "cu_seqlens_k"]),
    (dict(cu_seqlens_k=None, max_seqlen_k=None, seqused_k=torch.tensor([3, 2], dtype=torch.int32)), ValueError,
     ["seqused_k", "cu_seqlens_k"]),
    (dict(seqused_k=torch.tensor([3, 2])), TypeError, ["seqused_k", "int32", "int64"]),
    (dict(seqused_k=torch.tensor([3, 2, 1], dtype=torch.int32)), ValueError, ["seqused_k", "(num_seqs,)", "(2,)"]),
    (dict(seqused_k=torch.tensor([3, 7], dtype=torch.int32)), ValueError, ["seqused_k[1]=7", "[4, 11)", "10"]),
    (dict(seqused_k=torch.tensor([3, 1], dtype=torch.int32), max_seqlen_k=3), ValueError,
     ["sequence 1", "L_q=2", "L_k=1", "seqused_k"]),
    (dict(seqused_k=torch.tensor([4, 6], dtype=torch.int32), max_seqlen_k=5), ValueError,
     ["max_seqlen_k=5", "seqused_k", "6"]),
])
def test_rejects(over, error, words):
    with pytest.raises(error) as e:
        _call(**over)
    msg = str(e.value)
    assert "flash_msa_varlen_func" in msg and all(w in msg for w in words), msg


def test_key_tensors_share_their_own_length():
    x, _ = leaves(5, 10, seed=7, dtype=torch.float32)
    with pytest.raises(ValueError, match="v has total_tokens 9 but k has total_tokens 10"):
        api.flash_msa_warmup_varlen_func(*(x[n].detach() for n in NAMES[:4]), x["v"].detach()[:9], offsets([3, 2]), 3,
                                         K * BS, block_size=BS, cu_seqlens_k=offsets([4, 6]), max_seqlen_k=6)
    with pytest.raises(ValueError, match="q_proxy has total_tokens 4 but q has total_tokens 5"):
        api.flash_msa_varlen_func(x["q_proxy"].detach()[:4], *(x[n].detach() for n in NAMES[1:]), offsets([3, 2]),
                                  3, K * BS, block_size=BS, cu_seqlens_k=offsets([4, 6]), max_seqlen_k=6)


# --- the torch.library ops with key offsets --------------------------------------------------------------------

def _op_inputs(seed):
    """float32 (1, total, heads, D) inputs of the zigzag layout: two query sequences over one shared key range."""
    x, grad_out = leaves(8, 12, seed=seed, dtype=torch.float32)
    t = [x[n].detach().unsqueeze(0).requires_grad_(True) for n in NAMES]
    keys = (offsets([3, 5]), offsets([0, 12]), torch.tensor([6, 12], dtype=torch.int32))  # cu_q, cu_k, seqused_k
    return t, grad_out.to(torch.float32).unsqueeze(0), keys


def test_opcheck_with_key_offsets():
    from torch.library import opcheck

    t, grad_out, (cu_q, cu_k, used) = _op_inputs(8)
    for keys in ((cu_q, offsets([6, 6]), None), (cu_q, cu_k, used)):
        opcheck(torch.ops.flash_msa.select_blocks.default, (t[0].detach(), t[1].detach(), K, BS, SCALE, *keys))
        idx = torch.ops.flash_msa.select_blocks(t[0].detach(), t[1].detach(), K, BS, SCALE, *keys)
        opcheck(torch.ops.flash_msa.msa_forward.default, (*t, idx, BS, SCALE, *keys))
        out, lse, lse_p, _ = torch.ops.flash_msa.msa_forward(*t, idx, BS, SCALE, *keys)
        saved = [a.detach() for a in (*t, out, lse, lse_p)]
        opcheck(torch.ops.flash_msa.msa_backward.default,
                (*saved, idx, BS, SCALE, grad_out, torch.tensor(0.1), *keys))
        opcheck(torch.ops.flash_msa.warmup_forward.default, (*t, SCALE, *keys))
        out, lse, lse_p, _ = torch.ops.flash_msa.warmup_forward(*t, SCALE, *keys)
        saved = [a.detach() for a in (*t, out, lse, lse_p)]
        opcheck(torch.ops.flash_msa.warmup_backward.default,
                (*saved, SCALE, grad_out, torch.tensor(0.1), *keys))


def test_compiled_ops_with_key_offsets_equal_eager():
    t, grad_out, keys = _op_inputs(9)

    def step(qp, kp, q, k, v):
        idx = torch.ops.flash_msa.select_blocks(qp.detach(), kp.detach(), K, BS, SCALE, *keys)
        out, _, _, kl_rows = torch.ops.flash_msa.msa_forward(qp, kp, q, k, v, idx, BS, SCALE, *keys)
        return (out * grad_out).sum() + COEF * kl_rows.mean()

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        leaves_ = [a.detach().clone().requires_grad_(True) for a in t]
        loss = fn(*leaves_)
        results.append((loss.detach(), torch.autograd.grad(loss, leaves_)))
    assert torch.equal(results[0][0], results[1][0])
    for name, a, b in zip(NAMES, results[0][1], results[1][1]):
        assert torch.equal(a, b), name
        assert a.abs().max() > 0, name  # every input receives a gradient


def test_ops_reject_key_offsets_without_query_offsets():
    t, _, (_, cu_k, used) = _op_inputs(10)
    with pytest.raises(ValueError, match="cu_seqlens_k and seqused_k need cu_seqlens"):
        torch.ops.flash_msa.warmup_forward(*(a.detach() for a in t), SCALE, None, cu_k)
    with pytest.raises(ValueError, match="seqused_k needs cu_seqlens_k"):
        torch.ops.flash_msa.warmup_forward(*(a.detach() for a in t), SCALE, offsets([3, 5]), None, used)


def test_block_sparse_attention_takes_packed_sequences():
    """block_sparse_attention(cu_seqlens=...) equals the varlen reference: indices count blocks within each
    sequence; an index past its own sequence's blocks raises; B must be 1."""
    import flash_msa_rt as F
    from flash_msa_rt import reference

    g = torch.Generator().manual_seed(4)
    lengths = [70, 0, 150, 150]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(1, total, h, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    idx = torch.zeros(1, 2, total, 2, dtype=torch.int32)
    idx[:, :, 70 + 64:, 1] = 1  # a second block only where the sequence has one (block 64 of 150 tokens)
    idx[:, :, 220 + 64:, 1] = 1
    idx[:, :, :70, 1] = -1
    out, lse = F.block_sparse_attention(q, k, v, idx, 64, 0.3, layout="bshd", return_lse=True, cu_seqlens=cu)
    want = reference.block_sparse_forward_varlen(q, k, v, idx, cu_seqlens=cu, block_size=64, scale=0.3)
    torch.testing.assert_close(out, want[0])
    torch.testing.assert_close(lse, want[1])
    bad = idx.clone()
    bad[:, :, 5, 1] = 1  # block 1 of the 70-token first sequence is fine (70 > 64) ...
    bad[:, :, 75, 1] = 3  # ... block 3 of a 150-token sequence is not
    with pytest.raises(ValueError, match="block_indices"):
        F.block_sparse_attention(q, k, v, bad, 64, 0.3, layout="bshd", cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens packs sequences along S of a batch of one row"):
        F.block_sparse_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                 idx.expand(2, -1, -1, -1), 64, 0.3, layout="bshd", cu_seqlens=cu)
