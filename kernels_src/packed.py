"""Two 16-bit floats in one 32-bit register, and 8-byte global stores of two such words (inline PTX).

For epilogues that move a row's output between the lanes of a quad before storing it (the wgmma sparse forward):
shuffles move 32-bit registers, so the values travel packed, and the store takes the registers as they are (an
rmem tensor recast between the two types put the tensor in local memory).
"""

from cutlass import BFloat16, Float16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_CVT = {BFloat16: "cvt.rn.bf16x2.f32", Float16: "cvt.rn.f16x2.f32"}


@dsl_user_op
def pack_pair(lo: Float32, hi: Float32, dtype, *, loc=None, ip=None) -> Int32:
    """lo, hi rounded to nearest even in dtype (bf16 or f16, what `.to(dtype)` gives), lo in the low half."""
    word = llvm.inline_asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                           f"{_CVT[dtype]} $0, $1, $2;", "=r,f,f", has_side_effects=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return Int32(word)


@dsl_user_op
def store_global_v2(address: Int64, w0: Int32, w1: Int32, *, loc=None, ip=None) -> None:
    """*(uint2 *)address = (w0, w1); address must be 8-byte aligned."""
    llvm.inline_asm(None, [Int64(address).ir_value(loc=loc, ip=ip)] +
                    [Int32(w).ir_value(loc=loc, ip=ip) for w in (w0, w1)],
                    "st.global.v2.b32 [$0], {$1, $2};", "l,r,r,~{memory}", has_side_effects=True,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
