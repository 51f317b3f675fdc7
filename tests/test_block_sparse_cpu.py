"""block_sparse_attention's mapping onto the MSA kernels, on the CPU: the kernel indices (repeats removed, index heads
widened to lcm(Hi, Hk)) allow exactly the keys msa-semantics.md allows, and the kernel backend declines what the
kernels cannot run, with the reason."""

import pytest
import torch

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


def _problem(op="block_sparse_forward", dtype=torch.bfloat16, **over):
    config = {"head_dim": 128, "block_size": 128, "heads": 16, "index_heads": 2, "kv_group": 8, "varlen": False}
    if op == "block_sparse_backward":
        config["deterministic"] = False
    config.update(over)
    return dispatch.Problem(op, torch.device("cuda", 0), dtype, config)


@pytest.mark.parametrize("op", ["block_sparse_forward", "block_sparse_backward"])
@pytest.mark.parametrize("over, words", [
    ({"varlen": True}, "cu_seqlens"),
    ({"head_dim": 64}, "D 64"),
    ({"block_size": 64}, "block_size 64"),
    ({"heads": 48, "index_heads": 1, "kv_group": 48}, "G = H / lcm(Hi, Hk) = 48 / lcm(1, 1) = 48"),
    ({"heads": 12, "index_heads": 4, "kv_group": 12}, "12 / lcm(4, 1) = 3"),
])
def test_block_sparse_kernels_decline_with_a_reason(op, over, words):
    reason = kernels._block_sparse_supports(_problem(op, **over))
    assert reason is not None and words in reason, reason


def test_float32_and_deterministic_backward_are_declined():
    assert "float32" in kernels._block_sparse_supports(_problem(dtype=torch.float32))
    with pytest.warns(RuntimeWarning) if not kernels._warned_deterministic else _nothing():
        reason = kernels._block_sparse_supports(_problem("block_sparse_backward", deterministic=True))
    assert "use_deterministic_algorithms" in reason and "atomics" in reason


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
