"""fp8 selection's quantisation kernels (fp8_quant) on the GPU: byte for byte reference.fp8's quantize_rows and
quantize_key_blocks run on the same device, on fresh random inputs whose rows and blocks span bf16's and f16's
exponent ranges, with zero rows and blocks, negative zeros, subnormals, NaN and +-inf, partial last key blocks and
the non-contiguous views select_blocks_cuda receives. Outputs are poisoned before each launch so that an unwritten
element shows. Then fp8 selection itself: identical block indices with the kernels and with the torch pass.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
# Row magnitudes 2**e, e in [lo, hi), and 1% of elements SPIKE times larger: bf16 covers float32's exponent range
# down to subnormal inputs and products; f16 stays below its 65504 (2**7 * 16 * randn's few sigma) so that only
# the planted infs are infinite, and reaches its subnormals.
EXPONENTS = {torch.bfloat16: (-140, 110), torch.float16: (-26, 8)}
SPIKE = {torch.bfloat16: 4096.0, torch.float16: 16.0}
SHAPES = [  # B, S, H, D: partial last blocks, one token, GQA-sized and proxy-sized head counts
    (1, 1, 1, 128),
    (1, 127, 2, 128),
    (2, 1000, 1, 128),
    (1, 4173, 8, 128),
    (3, 257, 3, 64),
    (1, 2049, 1, 64),
]
LAYOUTS = ["bshd", "bhsd_view", "fused_slice"]
POISON = 0x55  # e4m3 13.0: finite and nonzero, so an unwritten element cannot pass as a zero


def make_input(B, S, H, D, dtype, layout, seed):
    """(B, S, H, D) with per-row and per-element magnitudes over the dtype's exponent range, in `layout`:
    contiguous, a transposed (B, H, S, D) tensor, or the first H heads of a fused (B, S, H + 3, D) projection."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lo, hi = EXPONENTS[dtype]
    shape = {"bshd": (B, S, H, D), "bhsd_view": (B, H, S, D), "fused_slice": (B, S, H + 3, D)}[layout]
    x = torch.randn(shape, device="cuda", generator=g)
    x = x * torch.exp2(torch.randint(lo, hi, shape[:-1] + (1,), device="cuda", generator=g).float())
    spikes = torch.rand(shape, device="cuda", generator=g) < 0.01  # in-row outliers: most elements far below amax
    x = torch.where(spikes, x * SPIKE[dtype], x).to(dtype)
    if layout == "bhsd_view":
        x = x.transpose(1, 2)
    elif layout == "fused_slice":
        x = x[:, :, :H]
    return x


def plant_specials(x, seed):
    """Zero rows, a zero key block, negative zeros, subnormals, NaN (both signs) and +-inf, in place."""
    neg_nan = {torch.bfloat16: -64, torch.float16: -512}[x.dtype]  # 0xffc0 / 0xfe00 as int16: NaN, sign bit set
    B, S, H, D = x.shape
    g = torch.Generator().manual_seed(seed)
    pick = lambda n: torch.randint(0, n, (1,), generator=g).item()  # noqa: E731
    tiny = torch.finfo(x.dtype).tiny
    x[pick(B), pick(S), pick(H)] = 0.0
    x[pick(B), pick(S), pick(H)] = -0.0
    x[pick(B), pick(S), pick(H), : D // 2] = tiny / 4  # subnormals beside a normal half row
    x[pick(B), pick(S), pick(H)] = tiny / 8  # a row of subnormals alone: scale 2**-126
    if S > 128:
        x[pick(B), 128:256, pick(H)] = 0.0  # a whole key block (or the partial last one) of zeros
    if S > 4:
        b, h = pick(B), pick(H)
        x[b, 1, h, pick(D)] = float("nan")
        x[b, 2, h, pick(D)] = float("inf")
        x[b, 3, h, pick(D)] = float("-inf")
        x.view(torch.int16)[b, 4, h, pick(D)] = neg_nan
    return x


def run_kernel(x, block_size):
    """The fp8_quant kernel on poisoned outputs (the launcher's own allocation would hide unwritten elements)."""
    from flash_msa_rt.loader import get_kernel
    from flash_msa_rt.ops import fp8_quant

    B, S, H, D = x.shape
    x8 = torch.full((B, S, H, D), POISON, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    scale = torch.full((B, -(-S // block_size), H), -3.0, dtype=torch.float32, device="cuda")
    config = fp8_quant.kernel_config(fp8_quant.DTYPES[x.dtype], D, block_size)
    get_kernel("fp8_quant", config, x.device)(x=x, x8=x8, scale=scale)
    return x8, scale


def assert_same_bytes(got8, want8, what):
    a, b = got8.view(torch.uint8), want8.contiguous().view(torch.uint8)
    bad = a != b
    if bad.any():
        where = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} e4m3 bytes differ, first at {where}: kernel "
                             f"{[int(a[tuple(w)]) for w in where]}, reference {[int(b[tuple(w)]) for w in where]}")


def assert_same_scales(got, want, what):
    """Equal where finite or infinite, NaN exactly where the reference is NaN (a NaN's payload is the input's)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN scales at {got.isnan().nonzero()[:5].tolist()} vs " \
                                          f"{nan.nonzero()[:5].tolist()}"
    assert torch.equal(got[~nan], want[~nan]), f"{what}: scales differ at {(got != want)[~nan].nonzero()[:5]}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_D{}".format(*s))
def test_rows_equal_quantize_rows(shape, dtype, layout):
    from flash_msa_rt.reference import fp8

    x = plant_specials(make_input(*shape, dtype, layout, seed=sum(shape)), seed=7)
    x8, scale = run_kernel(x, 1)
    want8, want_scale = fp8.quantize_rows(x)
    assert_same_bytes(x8, want8, "rows")
    assert_same_scales(scale, want_scale, "rows")


@pytest.mark.parametrize("block_size", [128, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_S{}_H{}_D{}".format(*s))
def test_key_blocks_equal_quantize_key_blocks(shape, dtype, layout, block_size):
    from flash_msa_rt.loader import built_values, device_arch
    from flash_msa_rt.reference import fp8

    if block_size not in built_values("fp8_quant", "block_size", device_arch(torch.cuda.current_device())):
        pytest.skip(f"fp8_quant block_size {block_size} is not built (build with --block-size {block_size})")
    x = plant_specials(make_input(*shape, dtype, layout, seed=sum(shape) + 1), seed=11)
    x8, scale = run_kernel(x, block_size)
    want8, want_scale = fp8.quantize_key_blocks(x, block_size)
    assert_same_bytes(x8, want8, f"key blocks of {block_size}")
    assert_same_scales(scale, want_scale, f"key blocks of {block_size}")


def test_specials_give_the_reference_bytes():
    """The special values' bytes spelled out: a NaN row is e4m3 NaN (0x7f / 0xff) throughout; in an inf row the
    infs are NaN and every finite element +-0; a zero row keeps its signs of zero; a row of subnormals gets the
    floor scale 2**-126."""
    from flash_msa_rt.reference import fp8

    x = torch.randn(1, 5, 1, 128, device="cuda").to(torch.bfloat16)
    x[0, 0, 0, 3] = float("nan")
    x[0, 1, 0, 4] = float("inf")
    x[0, 2] = -0.0
    x[0, 3] = torch.finfo(torch.bfloat16).tiny / 2
    x8, scale = run_kernel(x, 1)
    want8, _ = fp8.quantize_rows(x)
    assert_same_bytes(x8, want8, "specials")
    b = x8.view(torch.uint8)[0, :, 0]
    assert ((b[0] & 0x7F) == 0x7F).all()
    assert b[1, 4] & 0x7F == 0x7F and ((b[1] & 0x7F) == 0).sum() == 127
    assert (b[2] == 0x80).all()
    assert scale[0, 3, 0].item() == 2.0 ** -126 and (b[3] != 0).all()
    assert scale[0, 0, 0].isnan() and scale[0, 1, 0].item() == float("inf") and scale[0, 2, 0].item() == 1.0


def test_launcher_matches_and_refuses_misaligned_views():
    from flash_msa_rt.ops.fp8_quant import quantize_cuda
    from flash_msa_rt.reference import fp8

    x = make_input(2, 300, 2, 128, torch.bfloat16, "bshd", seed=3)
    x8, scale = quantize_cuda(x, 128)
    want8, want_scale = fp8.quantize_key_blocks(x, 128)
    assert_same_bytes(x8, want8, "launcher")
    assert torch.equal(scale, want_scale) and scale.is_contiguous() and x8.is_contiguous()
    with pytest.raises(ValueError, match="16-byte"):
        quantize_cuda(torch.zeros(1, 4, 1, 136, device="cuda", dtype=torch.bfloat16)[..., 4:132], 1)


def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(1, 4173, 8, 1, 16), (2, 1000, 4, 2, 8), (1, 257, 2, 1, 4)],
                         ids=lambda s: "B{}_S{}_Hp{}_Hpk{}_K{}".format(*s))
def test_selection_identical_with_kernel_and_torch_quantisation(shape, dtype):
    """select_blocks_cuda(..., "fp8") returns the same block indices whichever pass quantised (tuning.fp8_quant),
    and each choice really runs its own pass (the kernel's name in the profile, or not)."""
    from flash_msa_rt import tuning
    from flash_msa_rt.ops.select import select_blocks_cuda

    B, S, Hp, Hpk, K = shape
    g = torch.Generator(device="cuda").manual_seed(S)
    q = (torch.randn(B, Hp, S, 128, device="cuda", generator=g) * 3).to(dtype).transpose(1, 2)  # a bhsd view
    k = (torch.randn(B, S, Hpk, 128, device="cuda", generator=g) * 3).to(dtype)
    k[:, ::97] *= 50  # outlier keys: block scales that differ
    out = {}
    for how in ("kernel", "torch"):
        with tuning.override(fp8_quant={"quantize": how}):
            names = _kernel_names(lambda: out.__setitem__(how, select_blocks_cuda(q, k, K, 128, 0.09, "fp8")))
        assert any("fp8_quant" in n.replace("/", "") for n in names) == (how == "kernel"), (how, names)
    assert torch.equal(out["kernel"], out["torch"])
