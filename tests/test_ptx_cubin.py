import pytest

from build_tools.ptx import PtxError, entries, single_entry

PTX = """
.version 9.4
.target sm_90a
.address_size 64
.visible .entry kernel_cutlass_abc(
	.param .align 8 .b8 kernel_cutlass_abc_param_0[24],
	.param .align 64 .b8 kernel_cutlass_abc_param_1[128],
	.param .f32 kernel_cutlass_abc_param_2,
	.param .u32 kernel_cutlass_abc_param_3,
	.param .align 4 .b8 kernel_cutlass_abc_param_4[12],
	.param .u8 kernel_cutlass_abc_param_5
)
.reqntid 128, 1, 1
{
	ret;
}
"""


def test_param_list():
    e = single_entry(PTX)
    assert e.name == "kernel_cutlass_abc"
    assert e.params == [(24, 8), (128, 64), (4, 4), (4, 4), (12, 4), (1, 1)]


def test_exactly_one_entry_is_required():
    two = PTX + PTX.replace("kernel_cutlass_abc", "other")
    assert len(entries(two)) == 2
    with pytest.raises(PtxError, match="exactly one"):
        single_entry(two)
    with pytest.raises(PtxError, match="exactly one"):
        single_entry(".version 9.4\n")


def test_unknown_param_type_is_an_error():
    with pytest.raises(PtxError, match="unknown param type"):
        single_entry(".entry k(\n .param .v2 k_param_0\n)\n{}")
