"""Vector fp32 reductions to global memory (sm90+): one red instruction for two adjacent accumulator columns.

The mma.sync accumulator gives each thread pairs of adjacent columns, so red.global.add.v2.f32 halves the
instruction count of the scalar atomics the backward's fp32 accumulators need (dq, dk, dv, and the proxy's).
"""

from cutlass import Float32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def red_add_v2(address: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """*(float2 *)address += (a, b), relaxed, no return value. address must be 8-byte aligned."""
    llvm.inline_asm(
        res=None,
        operands_=[Int64(address).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
                   Float32(b).ir_value(loc=loc, ip=ip)],
        asm_string="red.global.add.v2.f32 [$0], {$1, $2};",
        constraints="l,f,f,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
