"""torch.compile(fullgraph=True) through the public API: the ops are opaque custom ops, the validation traces, and
forward and backward equal eager (aot_eager runs the same reference implementations)."""

from __future__ import annotations

import torch

from flash_msa_rt import block_sparse_attention, flash_msa_func, flash_msa_warmup_func, select_blocks

B, S, H, Hk, Hp, Hpk, D, Dp, BS = 2, 11, 4, 2, 2, 1, 8, 4, 4


class ThreeAttentions(torch.nn.Module):
    def forward(self, q_proxy, k_proxy, q, k, v, block_indices, kl_metric):
        sparse, kl = flash_msa_func(q_proxy, k_proxy, q, k, v, 2 * BS, block_size=BS, kl_metric=kl_metric)
        dense, kl_warm = flash_msa_warmup_func(q_proxy, k_proxy, q, k, v, 2 * BS, block_size=BS)
        bsa, lse = block_sparse_attention(q, k, v, block_indices, BS, scale=0.3, return_lse=True)
        return sparse, kl, dense, kl_warm, bsa, lse


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    heads = ((Hp, Dp), (Hpk, Dp), (H, D), (Hk, D), (Hk, D))
    return [torch.randn(B, h, S, d, generator=g).requires_grad_(True) for h, d in heads]


def _run(fn, tensors, idx, dO):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    metric = torch.zeros(())
    sparse, kl, dense, kl_warm, bsa, lse = fn(*leaves, idx, metric)
    loss = (sparse * dO[0]).sum() + (dense * dO[1]).sum() + (bsa * dO[2]).sum() + 0.3 * kl + 0.7 * kl_warm
    loss.backward()
    return [sparse, kl, dense, kl_warm, bsa, lse, metric] + [t.grad for t in leaves]


def test_compiled_module_equals_eager():
    torch._dynamo.reset()
    tensors = _inputs(0)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, -(-S // BS), (B, Hk, S, 2), generator=g, dtype=torch.int32)
    dO = [torch.randn(B, S, H * D, generator=g), torch.randn(B, S, H * D, generator=g),
          torch.randn(B, H, S, D, generator=g)]
    module = ThreeAttentions()
    want = _run(module, tensors, idx, dO)
    got = _run(torch.compile(module, backend="aot_eager", fullgraph=True), tensors, idx, dO)
    names = ["sparse", "kl", "dense", "kl_warm", "bsa", "lse", "kl_metric", "dq_proxy", "dk_proxy", "dq", "dk", "dv"]
    for name, g_, w in zip(names, got, want):
        torch.testing.assert_close(g_, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert want[6] == want[1] and want[1] > 0  # the metric holds the KL, in the compiled run too
    assert got[6] == got[1]


def test_fixed_length_api_reads_no_tensor_value():
    """Under FakeTensorMode every .item() / .tolist() / bool(tensor) raises: the fixed-length path of each public
    function runs there (its ops take their fake impls), so it never synchronises the host with a device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qp, kp, q, k, v = _inputs(2)
        idx = torch.zeros(B, Hk, S, 2, dtype=torch.int32)
        metric = torch.zeros(())
        out, kl = flash_msa_func(qp, kp, q, k, v, 2 * BS, block_size=BS, kl_metric=metric)
        (out.sum() + kl).backward()
        bshd = [t.transpose(1, 2) for t in (qp, kp, q, k, v)]
        out_w, kl_w = flash_msa_warmup_func(*bshd, 2 * BS, block_size=BS, layout="bshd")
        (out_w.sum() + kl_w).backward()
        bsa = block_sparse_attention(q, k, v, idx, BS)
        bsa.sum().backward()
        sel = select_blocks(qp, kp, 2 * BS, block_size=BS)
    assert out.shape == (B, S, H * D) and kl.shape == () and kl.dtype == torch.float32
    assert out_w.shape == (B, S, H * D) and bsa.shape == q.shape and sel.shape == (B, Hp, S, 2)
    assert qp.grad.shape == qp.shape and v.grad.shape == v.shape
