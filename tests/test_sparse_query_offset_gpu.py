"""The sparse MSA kernels with keys longer than their queries (H200): the forward (sparse_fwd, the KL pass, both
combines), the KL pass alone and the backward (bwd_delta, sparse_bwd, sparse_bwd_proxy, slot_sum) take a chunk's
S queries against Sk >= S keys, query row i at key position Sk - S + i (the kernels' offset, from the shapes), as a
context-parallel rank's chunk attends to its whole key prefix (flash_msa_rt.ops.packed, keys_longer).

Per case, through flash_msa_rt.ops.kernels' fixed-length ops on the chunk (rows [Sk - S, Sk) of a whole sequence):
- out, lse, lse_proxy, kl_rows equal the whole sequence's call's rows bit for bit (a row's partials are its own
  MMA rows against each selected block and the merges run in slot order, wherever the row sits in its tile);
- every output and gradient matches the float64 reference on the chunk (flash_msa_rt.tolerances, float32 baseline).
"""

from __future__ import annotations

import pytest
import torch

from flash_msa_rt import reference, tolerances

pytestmark = pytest.mark.gpu

D, BS = 128, 128
CASES = [  # (Sk, S): S not a multiple of 128; offsets inside a block, at a block edge, past a tile, zero
    (900, 823),  # offset 77, inside block 0
    (1000, 300),  # offset 700: past five blocks
    (640, 512),  # offset 128: a block edge, S a multiple of the block
    (700, 45),  # a short chunk at the end, offset 655 (inside block 5)
    (1300, 1300),  # offset 0: the fixed-length case
]
GROUPS = [(1, 2, 2), (4, 2, 1), (16, 1, 1)]  # (G, Hp, Hk)
NAMES = ("q_proxy", "k_proxy", "q", "k", "v")
TOP_K = 6


def _case_id(c):
    return "Sk{}_S{}".format(*c)


def _whole(Sk, G, Hp, Hk, dtype, seed):
    """The whole sequence's tensors (B = 1, Hpk = 1), its selection and upstream gradients of its rows."""
    from flash_msa_rt.ops.select import select_blocks_cuda

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = {n: torch.randn(1, Sk, h, D, device="cuda", generator=g).to(dtype)
         for n, h in zip(NAMES, (Hp, 1, G * Hp, Hk, Hk))}
    sel = select_blocks_cuda(x["q_proxy"], x["k_proxy"], TOP_K, BS, D ** -0.5)
    dout = torch.randn(1, Sk, G * Hp, D, device="cuda", generator=g).to(dtype)
    kl_grad = torch.rand(1, Hp, Sk, device="cuda", generator=g) + 0.5
    return x, sel, dout, kl_grad


def _chunk(x, S):
    """The chunk's views: its queries' rows [Sk - S, Sk), every key."""
    return [t[:, -S:] if n in ("q_proxy", "q") else t for n, t in x.items()]


@pytest.mark.parametrize("mma", ["sync", "wgmma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("G, Hp, Hk", GROUPS, ids=lambda v: str(v))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_chunk_forward_is_the_whole_sequences_rows(case, G, Hp, Hk, dtype, mma, force_mma):
    """msa_forward and msa_kl on the chunk: out, lse, lse_proxy and kl_rows are the whole call's rows, bitwise."""
    from flash_msa_rt.ops import kernels

    force_mma(mma)
    Sk, S = case
    x, sel, _, _ = _whole(Sk, G, Hp, Hk, dtype, seed=Sk + S + G)
    scale = D ** -0.5
    whole = kernels._msa_forward(*x.values(), sel, BS, scale)
    chunk = kernels._msa_forward(*_chunk(x, S), sel[:, :, -S:], BS, scale)
    kl = kernels._msa_kl(*_chunk(x, S), whole[1][:, :, -S:], sel[:, :, -S:], BS, scale)
    torch.cuda.synchronize()
    assert chunk[0].shape == (1, S, G * Hp, D) and chunk[1].shape == (1, G * Hp, S)
    for name, c, w, dim in zip(("out", "lse", "lse_proxy", "kl_rows"), chunk, whole, (1, 2, 2, 2)):
        assert torch.equal(c, w.narrow(dim, Sk - S, S)), f"{name}: the chunk's rows differ from the whole call's"
    for name, c, w in zip(("msa_kl lse_proxy", "msa_kl kl_rows"), kl, whole[2:]):
        assert torch.equal(c, w[:, :, -S:]), f"{name}: the chunk's rows differ from the whole call's"


def _reference(ins, sel, dout, kl_grad, scale, dt):
    x = [t.to(dt) for t in ins]
    o, lse, lse_p, kl = reference.msa_forward(*x, sel, BS, scale)
    grads = reference.msa_backward(*x, o, lse, lse_p, sel, BS, scale, dout.to(dt), kl_grad.to(dt))
    return {"out": o, "lse": lse, "lse_proxy": lse_p, "kl_rows": kl, **{f"d{n}": t for n, t in zip(NAMES, grads)}}


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("G, Hp, Hk", GROUPS, ids=lambda v: str(v))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_chunk_forward_and_backward_match_the_reference(case, G, Hp, Hk, dtype, deterministic):
    """msa_forward then msa_backward on the chunk (the backward's default path: tau on sm90a; deterministic: the
    slot sums at the rows' key positions) against the float64 reference on the chunk: dq and dq_proxy on the
    chunk's rows, dk, dv and dk_proxy on every key (the keys before the chunk's first query included)."""
    from flash_msa_rt.loader import device_arch
    from flash_msa_rt.ops import kernels

    if deterministic and device_arch(0) != "sm90a":
        pytest.skip("the deterministic backward kernels are sm90a's")
    Sk, S = case
    x, sel, dout, kl_grad = _whole(Sk, G, Hp, Hk, dtype, seed=3 * Sk + S + G)
    scale = D ** -0.5
    ins, sel, dout, kl_grad = _chunk(x, S), sel[:, :, -S:].contiguous(), dout[:, -S:], kl_grad[:, :, -S:]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out, lse, lse_p, kl_rows = kernels._msa_forward(*ins, sel, BS, scale)
        grads = kernels._msa_backward(*ins, out, lse, lse_p, sel, BS, scale, dout, kl_grad)
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(before)
    got = {"out": out, "lse": lse, "lse_proxy": lse_p, "kl_rows": kl_rows, **{f"d{n}": g for n, g in zip(NAMES, grads)}}
    want, base = (_reference(ins, sel, dout, kl_grad, scale, dt) for dt in (torch.float64, torch.float32))
    bad = []
    for name, g in got.items():
        assert g.shape == want[name].shape, name
        stat = torch.float32 if name in ("lse", "lse_proxy", "kl_rows") else None
        c = tolerances.check(name, g, want[name], base[name], result_dtype=stat)
        if not c.ok:
            bad.append(str(c))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case", CASES[:2], ids=_case_id)
def test_packed_chunks_run_unpadded_on_the_kernels(case):
    """Through the varlen op (cu_seqlens_k): packed.per_sequence gives the sparse ops the chunk unpadded, and the
    results are the fixed-length call's on the chunk, bitwise (the same launches)."""
    from flash_msa_rt.ops import kernels, library

    Sk, S = case
    x, sel, _, _ = _whole(Sk, 4, 2, 1, torch.bfloat16, seed=11)
    ins, sel = _chunk(x, S), sel[:, :, -S:].contiguous()
    scale = D ** -0.5
    cu = torch.tensor([0, S], dtype=torch.int32, device="cuda")
    keys = {"cu_seqlens_k": torch.tensor([0, Sk], dtype=torch.int32, device="cuda")}
    got = library.msa_forward(*ins, sel, BS, scale, cu, **keys)
    want = kernels._msa_forward(*ins, sel, BS, scale)
    torch.cuda.synchronize()
    for name, g, w in zip(("out", "lse", "lse_proxy", "kl_rows"), got, want):
        assert torch.equal(g, w), name
