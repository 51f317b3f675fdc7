"""proxy_block_scores on the GPU against the pure-PyTorch reference (fresh random inputs, poisoned output)."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [  # B, S, Hp, Hpk, Dp: odd lengths, partial tiles, GQA groups, both head dims
    (1, 1, 1, 1, 128),
    (1, 127, 2, 1, 128),
    (2, 129, 4, 2, 64),
    (1, 1000, 8, 1, 128),
    (2, 2049, 4, 4, 128),
    (1, 4173, 2, 1, 64),
]


def make_inputs(B, S, Hp, Hpk, Dp, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, Hp, Dp, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, S, Hpk, Dp, device="cuda", generator=g).to(torch.bfloat16)
    return q, k


def check_against_reference(scores, q, k, block_size, scale):
    from flash_msa_rt.reference import proxy_block_scores as reference

    ref64 = reference(q.double(), k.double(), block_size, scale).double()
    ref32 = reference(q.float(), k.float(), block_size, scale).double()
    assert scores.dtype == torch.float32
    assert not torch.isnan(scores).any(), "unwritten (poisoned) or NaN elements"
    masked = torch.isinf(ref64)
    assert torch.equal(torch.isinf(scores) & (scores < 0), masked), "-inf pattern differs from the causal mask"
    # Tolerance: a small multiple of the error of the same fp32 computation (another summation order), plus a
    # floor at fp32 resolution of the largest score.
    err32 = (ref32 - ref64)[~masked].abs().max().item() if (~masked).any() else 0.0
    scale_mag = ref64[~masked].abs().max().item() if (~masked).any() else 1.0
    tol = 4 * err32 + 8 * 2.0**-24 * q.shape[-1] * scale_mag
    err = (scores.double() - ref64)[~masked].abs().max().item() if (~masked).any() else 0.0
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"


@pytest.mark.parametrize("mma", ["sync", "wgmma"])  # sm90a builds both score pipelines (wgmma runs there)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_Hp{}_Hpk{}_D{}".format(*s))
def test_matches_reference(shape, mma, force_mma):
    from flash_msa_rt import proxy_block_scores

    force_mma(mma)
    B, S, Hp, Hpk, Dp = shape
    q, k = make_inputs(*shape, seed=hash(shape) % 1000)
    scale = Dp ** -0.5
    out = torch.full((B, Hp, S, -(-S // 128)), float("nan"), device="cuda")
    scores = proxy_block_scores(q, k, 128, scale, out=out)
    assert scores is out
    check_against_reference(scores, q, k, 128, scale)


def test_block_size_64_runs_or_names_its_build_command():
    """Bs = 64 is in the catalogue, but no build set carries it (only `--block-size 64` widens a build to it): where
    it was built it must be right, otherwise the error must say exactly how to build it. Both branches check."""
    from flash_msa_rt import MissingVariantError, proxy_block_scores
    from flash_msa_rt.loader import built_values, device_arch

    arch = device_arch(torch.cuda.current_device())
    q, k = make_inputs(2, 1111, 4, 2, 128, seed=64)
    if 64 not in built_values("block_scores", "block_size", arch, dtype="bf16"):
        command = f"python -m build_tools build --arch {arch} --dtype bf16 --head-dim 128 --block-size 64"
        with pytest.raises(MissingVariantError, match=re.escape(command)):
            proxy_block_scores(q, k, block_size=64, scale=0.1)
        return
    scores = proxy_block_scores(q, k, block_size=64, scale=0.1)
    assert scores.shape == (2, 4, 1111, 18)
    check_against_reference(scores, q, k, 64, 0.1)


def test_empty_inputs_launch_nothing():
    from flash_msa_rt import proxy_block_scores

    q, k = make_inputs(1, 1, 2, 1, 128, seed=0)
    empty = proxy_block_scores(q[:0], k[:0])
    assert empty.shape == (0, 2, 1, 1)


def test_strided_slices_of_a_fused_projection():
    from flash_msa_rt import proxy_block_scores

    B, S, Hp, Hpk, Dp = 2, 777, 4, 1, 128
    fused = torch.randn(B, S, (Hp + Hpk) * Dp + 64, device="cuda").to(torch.bfloat16)
    q = fused[..., : Hp * Dp].view(B, S, Hp, Dp)
    k = fused[..., Hp * Dp: (Hp + Hpk) * Dp].view(B, S, Hpk, Dp)
    assert not q.is_contiguous()
    check_against_reference(proxy_block_scores(q, k, 128, 0.1), q, k, 128, 0.1)


def test_other_stream_and_cuda_graph():
    from flash_msa_rt import proxy_block_scores

    q, k = make_inputs(1, 1500, 4, 1, 128, seed=7)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = proxy_block_scores(q, k)
    torch.cuda.current_stream().wait_stream(side)
    check_against_reference(on_side, q, k, 128, 128 ** -0.5)

    out = torch.empty_like(on_side)
    proxy_block_scores(q, k, out=out)  # warm: load the kernel, validate, encode outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        proxy_block_scores(q, k, out=out)
    q2, k2 = make_inputs(1, 1500, 4, 1, 128, seed=8)
    q.copy_(q2)
    k.copy_(k2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(out, q2, k2, 128, 128 ** -0.5)


def test_bad_inputs_are_named():
    from flash_msa_rt import proxy_block_scores

    q, k = make_inputs(1, 256, 2, 1, 128, seed=1)
    with pytest.raises(TypeError, match="q_proxy has dtype torch.float16"):
        proxy_block_scores(q.half(), k.half())
    with pytest.raises(NotImplementedError, match="head_dim 96"):
        proxy_block_scores(q[..., :96], k[..., :96])
    with pytest.raises(ValueError, match="proxy heads 2 must be a multiple of proxy key heads 3"):
        proxy_block_scores(q, torch.cat([k, k, k], dim=2))
    flat = torch.randn(256 * 2 * 128 + 1, device="cuda").to(torch.bfloat16)
    misaligned = flat[1:].view(1, 256, 2, 128)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        proxy_block_scores(misaligned, k)


def test_runtime_never_imported_cutlass():
    """A real launch in a fresh interpreter: afterwards no cutlass (or build-time package) module is loaded."""
    code = (
        "import sys, torch, flash_msa_rt\n"
        "q = torch.randn(1, 300, 2, 128, device='cuda').to(torch.bfloat16)\n"
        "s = flash_msa_rt.proxy_block_scores(q, q[:, :, :1]); torch.cuda.synchronize()\n"
        "assert torch.isfinite(s[0, 0, 299, :3]).all()\n"
        "print('LOADED:' + ','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('cutlass', 'kernels_src', 'build_tools'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("LOADED:"), r.stdout


def test_build_time_facts_match_the_loaded_kernel():
    """Registers and local memory read from the cubin at build time equal what the driver reports."""
    from flash_msa_rt import driver
    from flash_msa_rt.loader import get_kernel
    from flash_msa_rt import tuning
    from flash_msa_rt.ops.block_scores import kernel_config
    from flash_msa_rt.ops.device import arch_of

    mma = tuning.block_scores.choose(arch_of(torch.device("cuda", 0))).mma
    kernel = get_kernel("block_scores", kernel_config("bf16", 128, 128, mma), torch.device("cuda", 0))
    d = driver.cu()
    attr = d.CUfunction_attribute
    regs = driver.check(d.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, kernel._func), "regs")
    local = driver.check(d.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, kernel._func), "local")
    assert (regs, local) == (kernel.entry.registers, kernel.entry.local_bytes)


def test_first_call_inside_graph_capture():
    """A fresh process whose very first launch is captured: loading the cubin, validating and encoding TMA
    descriptors must all be legal during stream capture (a training step captured without an eager warm-up)."""
    code = textwrap.dedent("""
        import torch, flash_msa_rt
        from flash_msa_rt.reference import proxy_block_scores as ref
        q = torch.randn(1, 300, 2, 128, device="cuda").to(torch.bfloat16)
        k = torch.randn(1, 300, 1, 128, device="cuda").to(torch.bfloat16)
        out = torch.empty(1, 2, 300, 3, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            flash_msa_rt.proxy_block_scores(q, k, 128, 0.1, out=out)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        r = ref(q, k, 128, 0.1)
        fin = torch.isfinite(r)
        assert torch.equal(torch.isfinite(out), fin)
        print("MAXERR", (out[fin] - r[fin]).abs().max().item())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    err = float(r.stdout.split("MAXERR")[1])
    # This test is about capture; numerics are held to the fp32-derived tolerance in test_matches_reference.
    # Scores here are O(5), so 1e-3 still catches any wrong or missing tile.
    assert err < 1e-3, r.stdout
