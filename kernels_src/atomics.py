"""fp32 reductions to global memory (sm90+) for the backward's accumulators.

- `red_add_v2`: one red instruction for two adjacent accumulator columns (the mma.sync accumulator gives each
  thread pairs of adjacent columns), for the rows that leave once per work item (dk, dv, dk_p).
- `bulk_reduce_add_f32`: one cp.reduce.async.bulk per accumulator row, staged in shared memory, for the rows that
  leave once per tile (dq, dq_p). L2 applies a whole row per request instead of 8 bytes per red, which is what the
  dq traffic (34 GB at configuration (b), S = 64K) was bound by.
- `store_v2`, `bulk_store_f32`: the same two shapes as plain stores, for the deterministic variants, which write
  each item's (or entry's) rows to a partial buffer of its own that the runtime then sums in a fixed order.
"""

from cutlass import Float32, Int32, Int64
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


@dsl_user_op
def bulk_reduce_add_f32(dst: Int64, src: Int32, nbytes: int, *, loc=None, ip=None) -> None:
    """float dst[nbytes / 4] += shared src[...], asynchronously (bulk_group completion).

    dst: global address, src: shared::cta address, both 16-byte aligned, nbytes a multiple of 16. The issuing
    thread commits the group and waits for its reads (cp_async_bulk_wait_group(0, read=True)) before the shared
    source is overwritten; the writer threads fence the generic -> async proxy before the barrier that precedes
    the issue."""
    llvm.inline_asm(
        res=None,
        operands_=[Int64(dst).ir_value(loc=loc, ip=ip), Int32(src).ir_value(loc=loc, ip=ip)],
        asm_string=f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], {int(nbytes)};",
        constraints="l,r,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def store_v2(address: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """*(float2 *)address = (a, b). address must be 8-byte aligned."""
    llvm.inline_asm(
        res=None,
        operands_=[Int64(address).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
                   Float32(b).ir_value(loc=loc, ip=ip)],
        asm_string="st.global.v2.f32 [$0], {$1, $2};",
        constraints="l,f,f,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def bulk_store_f32(dst: Int64, src: Int32, nbytes: int, *, loc=None, ip=None) -> None:
    """float dst[nbytes / 4] = shared src[...], asynchronously: bulk_reduce_add_f32's copy without the add (the
    same alignment, bulk_group completion and waits)."""
    llvm.inline_asm(
        res=None,
        operands_=[Int64(dst).ir_value(loc=loc, ip=ip), Int32(src).ir_value(loc=loc, ip=ip)],
        asm_string=f"cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], {int(nbytes)};",
        constraints="l,r,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
