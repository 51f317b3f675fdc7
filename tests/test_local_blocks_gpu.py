"""local_blocks (L) on the selection kernel (issue 58; msa-semantics.md, "Selection"): row i selects its forced blocks
F(i) = {blk(i), ..., blk(i) - L + 1} (those >= 0) plus the K - |F(i)| best blocks below blk(i) - L + 1, ascending,
-1 last. The kernel takes L as a runtime scalar (kernels_src/select: no variant per L), so every L runs on the
kernels.

Checked against the reference (flash_msa_rt.reference.selection) row for row at L 1, 2 and 3, K 4 and 8, bf16 and
fp8 selection, blocks of 128 and of 64 (where built: the default build has 128 only), odd S (rows near the start
have fewer than L blocks, all of them forced): rows may differ at near ties only (>= 99.5 % equal, as
tests/test_select_fp8_gpu.py asks), and every row, equal or not, has the contract's layout with its forced blocks
present. Then packed sequences through the kernel backend (packed.per_sequence) and the public flash_msa_func with
local_blocks = 2, every op on the kernels.
"""

import pytest
import torch

import flash_msa_rt.reference as ref
from flash_msa_rt import api, tolerances
from tests import routing

pytestmark = pytest.mark.gpu

Dp = 128
ROWS_EQUAL = 0.995


def _inputs(B, S, Hp, Hpk, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(B, S, Hp, Dp, device="cuda", generator=g).to(dtype),
            torch.randn(B, S, Hpk, Dp, device="cuda", generator=g).to(dtype))


def _select_impl(qp, K, Bs, precision, L, varlen=False):
    """The kernel backend's select_blocks, as dispatch resolves it for this problem: asserted to be the kernels'
    (blocks of 64 are an on-request build: skipped with the kernel backend's reason where they are not built)."""
    from flash_msa_rt.ops import dispatch, kernels
    from flash_msa_rt.ops.backends import Problem

    config = dict(proxy_head_dim=Dp, block_size=Bs, top_k_blocks=K, varlen=varlen, separate_keys=False,
                  select_precision=precision)
    if L != 1:
        config["local_blocks"] = L  # as flash_msa_rt.ops.library passes it
    reason = kernels.KERNELS.supports(Problem("select_blocks", qp.device, qp.dtype, config))
    if reason and Bs != 128:
        pytest.skip(f"selection at block_size {Bs} is not built here: {reason}")
    impl = dispatch.implementation("select_blocks", qp.device, qp.dtype, **config)
    assert impl is kernels.KERNELS.ops["select_blocks"], f"select_blocks at {config} does not run on the kernels"
    return impl


def check_forced_layout(sel: torch.Tensor, K: int, Bs: int, L: int, key_offset: int = 0):
    """Every row: its forced blocks present, min(K, blk(i) + 1) blocks in all, distinct and ascending, none after
    the local block, -1 after them (key_offset: S_k - S, the queries' key positions)."""
    B, Hp, S, _ = sel.shape
    blk = ((torch.arange(S, device=sel.device) + key_offset) // Bs).view(1, 1, S, 1)
    forced = blk - torch.arange(L, device=sel.device).view(1, 1, 1, L)  # (1, 1, S, L)
    present = (sel.unsqueeze(-1) == forced.unsqueeze(-2)).any(-2)  # (B, Hp, S, L)
    assert (present | (forced < 0)).all(), "a forced block is missing"
    n = torch.clamp(blk, max=K - 1) + 1  # min(K, blk + 1)
    slot = torch.arange(K, device=sel.device).view(1, 1, 1, K)
    real = slot < n
    assert ((sel >= 0) == real).all(), "wrong number of selected blocks (or -1 not last)"
    assert ((sel <= blk) | ~real).all(), "a block after the local one"
    if K > 1:
        assert ((sel[..., 1:] > sel[..., :-1]) | ~real[..., 1:]).all(), "blocks not distinct and ascending"


def _rows_equal(got, want):
    return (got == want).all(-1).double().mean().item()


@pytest.mark.parametrize("Bs", [128, 64])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("K", [4, 8])
@pytest.mark.parametrize("L", [1, 2, 3])
def test_kernel_selection_with_local_blocks_equals_the_reference(L, K, precision, Bs):
    B, S, Hp, Hpk = 2, 1001, 4, 2  # odd S: a partial last block; blocks 0 .. L - 2 hold rows with |F(i)| < L
    qp, kp = _inputs(B, S, Hp, Hpk, seed=100 * L + 10 * K + Bs + (precision == "fp8"))
    scale = Dp ** -0.5
    sel = _select_impl(qp, K, Bs, precision, L)(qp, kp, K, Bs, scale, precision=precision, local_blocks=L)
    want = ref.select_blocks(qp, kp, K, Bs, scale, precision, local_blocks=L)
    assert sel.shape == want.shape and sel.dtype == torch.int32
    check_forced_layout(sel, K, Bs, L)
    check_forced_layout(want, K, Bs, L)  # the reference's own rows, the same rule
    same = _rows_equal(sel, want)
    assert same >= ROWS_EQUAL, f"rows equal to the reference: {same:.4f} < {ROWS_EQUAL}"
    # the rows of blocks 0 .. L - 1 have no candidate (every block they see is forced): no score decides them
    early = slice(0, min(S, L * Bs))
    assert torch.equal(sel[:, :, early], want[:, :, early])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_local_blocks_change_the_selection(precision):
    """L = 3 is not L = 1 on the kernels (the scalar really reaches them), and L = K selects the K most recent
    blocks exactly."""
    K, Bs = 4, 128
    qp, kp = _inputs(1, 1537, 2, 1, seed=5)
    impl = _select_impl(qp, K, Bs, precision, 3)
    one = impl(qp, kp, K, Bs, 0.09, precision=precision)
    three = impl(qp, kp, K, Bs, 0.09, precision=precision, local_blocks=3)
    assert not torch.equal(one, three)
    check_forced_layout(three, K, Bs, 3)
    all_forced = impl(qp, kp, K, Bs, 0.09, precision=precision, local_blocks=K)
    assert torch.equal(all_forced, ref.select_blocks(qp, kp, K, Bs, 0.09, precision, local_blocks=K))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_packed_sequences_with_local_blocks_on_the_kernels(precision):
    """cu_seqlens through the kernel backend (packed.per_sequence: runs, padded buckets) with L = 2, against
    reference.select_blocks_varlen; block indices relative to each sequence."""
    from flash_msa_rt.ops import library as ops

    K, Bs, L = 4, 128, 2
    lengths = [300, 1001, 1001, 77, 640]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qp, kp = _inputs(1, sum(lengths), 4, 2, seed=17)
    _select_impl(qp, K, Bs, precision, L, varlen=True)
    sel = ops.select_blocks(qp, kp, K, Bs, 0.09, cu, None, None, precision, L)
    routing.assert_ran_on_kernels(["select_blocks"])
    want = ref.select_blocks_varlen(qp, kp, cu, K, Bs, 0.09, precision=precision, local_blocks=L)
    same = _rows_equal(sel, want)
    assert same >= ROWS_EQUAL, same
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        check_forced_layout(sel[:, :, a:b], K, Bs, L)


def test_flash_msa_func_with_local_blocks_runs_on_the_kernels():
    """The public function with local_blocks = 2: selection, forward and backward all on the kernels; the selection
    the reference's (near ties aside) with every row's forced blocks, out and gradients against the float64
    reference on that selection (test_sinks_gpu's rule)."""
    D, Bs, L = 128, 128, 2
    B, S, H, Hk, Hp, Hpk = 1, 1500, 8, 2, 4, 1
    g = torch.Generator(device="cuda").manual_seed(29)
    shapes = {"q_proxy": Hp, "k_proxy": Hpk, "q": H, "k": Hk, "v": Hk}
    leaves = {n: torch.randn(B, S, h, D, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
              for n, h in shapes.items()}
    dO = torch.randn(B, S, H, D, generator=g, device="cuda").to(torch.bfloat16)
    metric = torch.zeros((), device="cuda")
    idx = api.select_blocks(leaves["q_proxy"], leaves["k_proxy"], 4 * Bs, layout="bshd", local_blocks=L)
    out, kl = api.flash_msa_func(*leaves.values(), 4 * Bs, layout="bshd", kl_metric=metric, local_blocks=L)
    (out.float() * dO.reshape(B, S, -1).float()).sum().add(0.3 * kl).backward()
    routing.assert_ran_on_kernels(["select_blocks", "msa_forward", "msa_backward"])

    check_forced_layout(idx, 4, Bs, L)
    want_idx = ref.select_blocks(leaves["q_proxy"].detach(), leaves["k_proxy"].detach(), 4, Bs, D ** -0.5,
                                 local_blocks=L)
    assert _rows_equal(idx, want_idx) >= ROWS_EQUAL
    x64 = [t.detach().double().cpu() for t in leaves.values()]
    out64, lse64, lsep64, kl64 = ref.msa_forward(*x64, idx.cpu(), Bs, D ** -0.5)
    grads64 = ref.msa_backward(*x64, out64, lse64, lsep64, idx.cpu(), Bs, D ** -0.5, dO.double().cpu(),
                               torch.tensor(0.3 / kl64.numel(), dtype=torch.float64))
    tolerances.assert_ok(tolerances.check("out", out.view(B, S, H, D).cpu(), out64))
    exact = float(kl64.mean())
    assert abs(float(metric) - exact) <= 1e-3 * exact, (float(metric), exact)
    for (name, t), want in zip(leaves.items(), grads64):
        tolerances.assert_ok(tolerances.check(f"d{name}", t.grad.cpu(), want))
