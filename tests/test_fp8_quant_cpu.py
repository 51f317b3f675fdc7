"""fp8 selection's quantisation kernels (kernels_src/fp8_quant) without a GPU: the variants fp8 selection launches
are built, names spell every field, the tuning choice and its override, the launcher's input checks, and the
generated code keeps what byte equality with reference.fp8 rests on (no flush of subnormals to zero, one
round-to-nearest conversion to e4m3, 16-byte loads). The bytes themselves: tests/test_quant_fp8_gpu.py."""

import re

import pytest
import torch

from flash_msa_rt import tuning
from flash_msa_rt.grid import compile_rule
from flash_msa_rt.manifest import variant_name
from flash_msa_rt.ops import fp8_quant as rt_quant
from flash_msa_rt.ops import select as rt_select
from kernels_src import fp8_quant
from kernels_src.catalogue import variants
from kernels_src.spec import DEFAULT, OPT_IN


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_the_variants_fp8_selection_launches_are_built(arch):
    """sm90a's default build holds what its fp8 selection launches by default; elsewhere the default is the torch
    pass, and the kernels forced there are in the opt-in set."""
    default = {s.name for s in variants((arch,))}
    everything = {s.name for s in variants((arch,), sets="all")}
    for dt in ("bf16", "f16"):
        for dp in (64, 128):
            launched = rt_select.quantize_variants(dt, dp, 128, arch, "fp8")
            assert bool(launched) == (arch == "sm90a")
            assert {variant_name(op, cfg, arch) for op, cfg in launched} <= default
            with tuning.override(fp8_quant={"quantize": "kernel"}):
                forced = rt_select.quantize_variants(dt, dp, 128, arch, "fp8")
            assert [cfg["block_size"] for _, cfg in forced] == [1, 128]
            assert {variant_name(op, cfg, arch) for op, cfg in forced} <= everything
            assert rt_select.quantize_variants(dt, dp, 128, arch, "bf16") == []


def test_tuning_choice_and_override():
    assert tuning.fp8_quant.choose("sm90a").quantize == "kernel"
    assert tuning.fp8_quant.choose("sm100a").quantize == "torch"
    with tuning.override(fp8_quant={"quantize": "torch"}):
        assert tuning.fp8_quant.choose("sm90a").quantize == "torch"
    assert tuning.fp8_quant.choose("sm90a").quantize == "kernel"
    with pytest.raises(ValueError, match="fp8_quant has no fields"):
        with tuning.override(fp8_quant={"engine": "torch"}):
            pass


def test_names_spell_every_field_and_sets_follow_the_arch():
    base = fp8_quant.Config()
    assert base.variant_name("sm90a") == "fp8_quant_bf16_d128_b1_t256_sm90a"
    names = {base.variant_name("sm90a")}
    for change in ({"dtype": "f16"}, {"head_dim": 64}, {"block_size": 128}, {"threads": 128}):
        names.add(fp8_quant.Config(**{**base.__dict__, **change}).variant_name("sm90a"))
    assert len(names) == 5
    assert fp8_quant.build_set(base, "sm90a") == DEFAULT and fp8_quant.build_set(base, "sm100a") == OPT_IN
    built = {s.name for s in variants(("sm90a",), only=["fp8_quant_*"])}
    assert built == {f"fp8_quant_{dt}_d{d}_b{bs}_t256_sm90a" for dt in ("bf16", "f16") for d in (64, 128)
                     for bs in (1, 128)}
    wider = {s.name for s in variants(("sm90a",), only=["fp8_quant_*"], block_sizes=(64, 128))}
    assert "fp8_quant_f16_d64_b64_t256_sm90a" in wider


@pytest.mark.parametrize("change, field", [({"threads": 128}, "threads"), ({"block_size": 32}, "block_size"),
                                           ({"dtype": "e4m3"}, "dtype"), ({"head_dim": 96}, "head_dim")])
def test_refusals_name_the_field(change, field):
    ok, reason = fp8_quant.can_implement(fp8_quant.Config(**change), "sm90a")
    assert not ok and reason.startswith(field), reason


def test_grids_cover_every_row_and_block():
    rows = fp8_quant.build_spec(fp8_quant.Config(head_dim=128), "sm90a")
    env = {"B": 2, "S": 1000, "H": 3, "NB": 1000}
    assert [compile_rule(r)(env) for r in rows.grid] == [-(-6000 // 32), 1, 1]  # 16 rows a pass, 2 per lane
    assert fp8_quant.rows_per_cta(fp8_quant.Config(head_dim=64)) == 64
    blocks = fp8_quant.build_spec(fp8_quant.Config(block_size=128), "sm90a")
    env["NB"] = 8
    assert [compile_rule(r)(env) for r in blocks.grid] == [24, 2, 1]
    assert blocks.smem_bytes == 32 and rows.smem_bytes == 0
    for bs in (64, 128):  # whole passes of 16-byte loads over a key block
        for d in (64, 128):
            c = fp8_quant.Config(head_dim=d, block_size=bs)
            assert bs % fp8_quant.rows_per_pass(c) == 0


def test_runtime_config_is_the_catalogues():
    for dt in ("bf16", "f16"):
        for bs in (1, 64, 128):
            assert fp8_quant.Config(**rt_quant.kernel_config(dt, 128, bs)) in fp8_quant.configs(block_sizes=(64, 128))


def test_launcher_refuses_what_the_kernel_cannot_read():
    with pytest.raises(TypeError, match="float32"):
        rt_quant.quantize_cuda(torch.zeros(1, 4, 1, 128), 1)
    misaligned = torch.zeros(1, 4, 1, 136, dtype=torch.bfloat16)[..., 4:132]  # 8-byte offset
    with pytest.raises(ValueError, match="16-byte"):
        rt_quant.quantize_cuda(misaligned, 1)
    odd_stride = torch.zeros(1, 4, 132, dtype=torch.bfloat16)[..., :128].unsqueeze(2)  # 264-byte rows
    with pytest.raises(ValueError, match="16-byte"):
        rt_quant.quantize_cuda(odd_stride, 128)


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
@pytest.mark.parametrize("block_size", [1, 128])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_generated_code_keeps_the_reference_arithmetic(arch, block_size, dtype):
    """fp32 products without .ftz (a subnormal input or product must not flush: a row of bf16 subnormals has scale
    2**-126 and nonzero e4m3 bytes), one cvt.rn.satfinite to e4m3 per pair, 16-byte loads and 8-byte stores, no
    local memory."""
    pytest.importorskip("cutlass", reason="the build-stage tests need nvidia-cutlass-dsl (pip install '.[test]')")
    from kernels_src.fp8_quant.build import compile

    ptx = compile(fp8_quant.Config(dtype=dtype, block_size=block_size), arch).ptx
    assert "ftz" not in ptx
    muls = re.findall(r"\bmul(?:\.rn)?\.f32\b", ptx)
    cvts = re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)
    lanes_rows = fp8_quant.ROWS_PER_LANE if block_size == 1 else block_size // fp8_quant.rows_per_pass(
        fp8_quant.Config(block_size=block_size))
    assert len(muls) == 8 * lanes_rows and len(cvts) == 4 * lanes_rows, (len(muls), len(cvts))
    assert len(re.findall(r"ld\.global(?:\.nc)?\.v4\.(?:b32|u32)", ptx)) == lanes_rows
    assert len(re.findall(r"st\.global\.(?:v4\.b16|v2\.b32|b64)", ptx)) == lanes_rows
    assert ".local" not in ptx
