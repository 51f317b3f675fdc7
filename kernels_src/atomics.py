"""fp32 reductions to global memory (sm90+) for the backward's accumulators.

- `red_add_f32`: one fp32 red (the tau kernel's KL shares: two warpgroups' halves of a row onto a zero, so the
  sum is the same whichever lands first).
- `red_add_v2`: one red instruction for two adjacent accumulator columns (the mma.sync accumulator gives each
  thread pairs of adjacent columns), for the rows that leave once per work item (dk, dv, dk_p).
- `bulk_reduce_add_f32`: one cp.reduce.async.bulk per accumulator row, staged in shared memory, for the rows that
  leave once per tile (dq, dq_p). L2 applies a whole row per request instead of 8 bytes per red, which is what the
  dq traffic (34 GB at configuration (b), S = 64K) was bound by.
- `bulk_store_f32`: bulk_reduce_add_f32 as a plain store, for the deterministic variants, which write each
  entry's dq rows to a partial row of its own that the runtime then sums in a fixed order.
- `wait_flag`, `raise_flag`: an acquire / release pair on a global int32 flag, by which the deterministic
  variants' items of one key block take turns at their dk / dv atomics, in item order (CUTLASS's generic barrier
  pattern: one thread waits or signals, the CTA barrier orders the others).
"""

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def _asm(asm: str, constraints: str, operands, *, loc, ip) -> None:
    """One inline PTX statement with side effects and no result (the operands already IR values)."""
    llvm.inline_asm(res=None, operands_=operands, asm_string=asm, constraints=constraints, has_side_effects=True,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def red_add_f32(address: Int64, a: Float32, *, loc=None, ip=None) -> None:
    """*(float *)address += a, relaxed, no return value."""
    _asm("red.global.add.f32 [$0], $1;", "l,f,~{memory}",
         [Int64(address).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip)


@dsl_user_op
def red_add_v2(address: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """*(float2 *)address += (a, b), relaxed, no return value. address must be 8-byte aligned."""
    _asm("red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f,~{memory}",
         [Int64(address).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
          Float32(b).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip)


@dsl_user_op
def bulk_reduce_add_f32(dst: Int64, src: Int32, nbytes: int, *, loc=None, ip=None) -> None:
    """float dst[nbytes / 4] += shared src[...], asynchronously (bulk_group completion).

    dst: global address, src: shared::cta address, both 16-byte aligned, nbytes a multiple of 16. The issuing
    thread commits the group and waits for its reads (cp_async_bulk_wait_group(0, read=True)) before the shared
    source is overwritten; the writer threads fence the generic -> async proxy before the barrier that precedes
    the issue."""
    _asm(f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], {int(nbytes)};", "l,r,~{memory}",
         [Int64(dst).ir_value(loc=loc, ip=ip), Int32(src).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip)


@dsl_user_op
def bulk_store_f32(dst: Int64, src: Int32, nbytes: int, *, loc=None, ip=None) -> None:
    """float dst[nbytes / 4] = shared src[...], asynchronously: bulk_reduce_add_f32's copy without the add (the
    same alignment, bulk_group completion and waits)."""
    _asm(f"cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], {int(nbytes)};", "l,r,~{memory}",
         [Int64(dst).ir_value(loc=loc, ip=ip), Int32(src).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip)


@dsl_user_op
def wait_flag(address: Int64, *, loc=None, ip=None) -> None:
    """Spin until the int32 at address is non-zero, with gpu-scope acquire semantics (what the flag's raiser wrote
    before raise_flag is visible to this thread after it; a CTA barrier after it extends that to the CTA)."""
    _asm("{\n\t.reg .b32 f;\n\t.reg .pred p;\n\tWAIT${:uid}:\n\t"
         "ld.acquire.gpu.global.b32 f, [$0];\n\tsetp.eq.s32 p, f, 0;\n\t"
         "@p nanosleep.u32 64;\n\t@p bra WAIT${:uid};\n\t}",
         "l,~{memory}", [Int64(address).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip)


@dsl_user_op
def raise_flag(address: Int64, *, loc=None, ip=None) -> None:
    """*(int32 *)address = 1 with gpu-scope release semantics: called by one thread after a CTA barrier that
    follows the CTA's writes, which then happen before anything a wait_flag on this flag is followed by."""
    _asm("{\n\t.reg .b32 one;\n\tmov.b32 one, 1;\n\tst.release.gpu.global.b32 [$0], one;\n\t}", "l,~{memory}",
         [Int64(address).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip)
