"""block_sparse_attention's mapping onto the MSA kernels, on the CPU: the kernel indices (repeats removed, index heads
widened to lcm(Hi, Hk)) allow exactly the keys msa-semantics.md allows, and the kernel backend declines what the
kernels cannot run, with the reason."""

import pytest
import torch

from flash_msa_rt import tuning
from flash_msa_rt.ops import block_sparse, dispatch, kernels
from tests.oracle import allowed_from_indices


def _per_head(allowed, H):
    """(B, Hi, S, S) allowed keys -> (B, H, S, S): index head i serves heads [i H / Hi, (i + 1) H / Hi)."""
    return allowed.repeat_interleave(H // allowed.shape[1], dim=1)


@pytest.mark.parametrize("H, Hk, Hi", [(16, 2, 2), (8, 2, 8), (16, 4, 1), (12, 4, 3), (32, 2, 2), (6, 3, 2)])
def test_kernel_indices_allow_the_same_keys(H, Hk, Hi):
    B, S, K, Bs = 2, 37, 6, 4
    gen = torch.Generator().manual_seed(H * 100 + Hk * 10 + Hi)
    idx = torch.randint(-1, -(-S // Bs), (B, Hi, S, K), generator=gen, dtype=torch.int32)
    idx[:, :, :, 1] = idx[:, :, :, 0]  # repeats
    got = block_sparse.kernel_indices(idx, H, Hk)
    L = block_sparse.kernel_heads(H, Hk, Hi)
    assert got.dtype == torch.int32 and got.shape == (B, L, S, K) and got.is_contiguous()
    assert L % Hk == 0 and L % Hi == 0 and H % L == 0
    live = got >= 0
    s = torch.sort(torch.where(live, got, torch.full_like(got, -2)), dim=-1).values
    assert not ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(), "a row still repeats a block"
    torch.testing.assert_close(_per_head(allowed_from_indices(got, S, Bs), H),
                               _per_head(allowed_from_indices(idx, S, Bs), H), rtol=0, atol=0)
    # each kernel head's query heads share one KV head (what the kernels' hp_per_hk assumes)
    G = H // L
    for p in range(L):
        assert len({h // (H // Hk) for h in range(p * G, (p + 1) * G)}) == 1


@pytest.mark.parametrize("H, Hk, Hi, budget_heads", [(8, 2, 2, 0), (8, 2, 2, 1.1), (8, 4, 1, 0), (12, 4, 3, 2.2)])
def test_forward_on_emulated_kernels_matches_the_reference(H, Hk, Hi, budget_heads, monkeypatch):
    """block_sparse_forward_cuda with sparse_fwd and sparse_combine replaced by their emulated contracts
    (tests/sparse_emulate.py) on the views they are given, in one chunk or in chunks of kernel heads:
    out and lse are the reference's (float64 inputs; the launcher keeps the statistics in float32)."""
    from flash_msa_rt import reference
    from flash_msa_rt.ops import partials, sparse_fwd
    from flash_msa_rt.ops import sparse_plan as sp
    from tests.sparse_emulate import emulate_forward

    B, S, D, K, Bs = 2, 600, 16, 5, 128
    gen = torch.Generator().manual_seed(H + Hk + Hi)
    q, k, v = (torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (H, Hk, Hk))
    idx = torch.randint(-1, -(-S // Bs), (B, Hi, S, K), generator=gen, dtype=torch.int32)
    idx[:, :, :, 1] = idx[:, :, :, 0]  # repeats
    idx[0, 0, 300] = -1  # an empty row
    plans, last = {}, {}

    def recorded_chunk_plans(*args, **kwargs):
        out = sp.chunk_plans(*args, **kwargs)
        plans.update({id(p.items): p for chunk in out.values() for p in chunk})
        return out

    def emulated_kernel(op, config, device):
        assert op in ("sparse_fwd", "sparse_combine"), op  # no KL pass without a proxy

        def fwd(q, k, v, o_part, lse_part, items, scale, hp, hp_per_hk, **_):
            plan = last["fwd"] = plans[id(items)]
            assert hp == plan.Hp and k.shape[2] * hp_per_hk == hp and q.shape[2] == hp * plan.group
            zeros = torch.zeros(q.shape[0], q.shape[1], hp, q.shape[3], dtype=q.dtype)  # no proxy
            o_part[:], lse_part[:] = emulate_forward(plan, q, k, v, zeros, zeros[:, :, :1], scale)

        def combine(block_indices, o_part, lse_part, out, lse, query_offset):
            out[:], lse[:] = partials.combine_forward(last["fwd"], block_indices, o_part, lse_part)

        return {"sparse_fwd": fwd, "sparse_combine": combine}[op]

    monkeypatch.setattr(sparse_fwd, "chunk_plans", recorded_chunk_plans)
    monkeypatch.setattr(sparse_fwd, "get_kernel", emulated_kernel)
    L, G = block_sparse.kernel_heads(H, Hk, Hi), block_sparse.kernel_group(H, Hk, Hi)
    over = {}
    if budget_heads:  # chunks of kernel heads
        per_head = B * S * K * (G * D * 2 + 4 * (G + 3 * partials.kl_groups(Bs)))
        over = {"sparse_fwd": {"partials_budget": int(budget_heads * per_head)}}
        assert sparse_fwd.forward_chunks(B, S, L, Hk, L, K, G, D, Bs, int(budget_heads * per_head))[0] < L
    with tuning.override(**over):
        out, lse = block_sparse.block_sparse_forward_cuda(q, k, v, idx, Bs, D ** -0.5)
    want_out, want_lse = reference.block_sparse_forward(q, k, v, idx, Bs, D ** -0.5)
    assert out.shape == q.shape and lse.shape == (B, H, S) and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)  # the launcher keeps lse_part in float32
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)


def _problem(op="block_sparse_forward", dtype=torch.bfloat16, **over):
    config = {"head_dim": 128, "block_size": 128, "heads": 16, "index_heads": 2, "kv_group": 8, "varlen": False}
    if op == "block_sparse_backward":
        config["deterministic"] = False
    config.update(over)
    return dispatch.Problem(op, torch.device("cuda", 0), dtype, config)


@pytest.mark.parametrize("op", ["block_sparse_forward", "block_sparse_backward"])
@pytest.mark.parametrize("over, words", [
    ({"head_dim": 256}, "D 256"),
    ({"block_size": 64}, "block_size 64"),
    ({"heads": 48, "index_heads": 1, "kv_group": 48}, "G = H / lcm(Hi, Hk) = 48 / lcm(1, 1) = 48"),
    ({"heads": 12, "index_heads": 4, "kv_group": 12}, "12 / lcm(4, 1) = 3"),
])
def test_block_sparse_kernels_decline_with_a_reason(op, over, words, catalogue_artifacts):
    catalogue_artifacts("sm90a")  # what is built: the default sm90a build's manifest
    reason = kernels._block_sparse_supports(_problem(op, **over))
    assert reason is not None and words in reason, reason


@pytest.mark.parametrize("op", ["block_sparse_forward", "block_sparse_backward"])
def test_packed_block_sparse_runs_on_the_kernels(op, catalogue_artifacts):
    """cu_seqlens: the kernels take packs one run of equal lengths at a time (flash_msa_rt.ops.packed)."""
    catalogue_artifacts("sm90a")
    assert kernels._block_sparse_supports(_problem(op, varlen=True)) is None


def test_float32_and_deterministic_backward_are_declined():
    assert "float32" in kernels._block_sparse_supports(_problem(dtype=torch.float32))
    with pytest.warns(RuntimeWarning):  # the autouse fixture re-armed the warning
        reason = kernels._block_sparse_supports(_problem("block_sparse_backward", deterministic=True))
    assert "use_deterministic_algorithms" in reason and "atomics" in reason
