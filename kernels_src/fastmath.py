"""2^x on the FP32 pipe instead of the MUFU unit (inline PTX), for kernels whose exponentials outrun MUFU.

An SM issues 16 MUFU ex2 per clock against 128 FP32 operations. A kernel that takes one exponential per two or
three other FP32 operations (the KL pass: S * scale - lse, exp2, tau +=) waits on MUFU while the FP32 pipe idles;
computing some of its exponentials here moves them onto the idle pipe (FlashAttention-4's trick on Blackwell).

    x = max(x, -125);  n = round(x) (by adding and taking away 1.5 * 2^23);  f = x - n in [-0.5, 0.5]
    2^x = p(f) * 2^n, with p a degree-5 polynomial (relative-error minimax on [-0.5, 0.5], 7.5e-8) and the
    product formed by adding n to p's exponent bits.

X
predicate ones. Below -125 it returns 0 (ex2.approx.ftz returns 0 below -126, and 2^-125 is 2.4e-38), so a
masked -inf stays exactly 0; NaN stays NaN. EXP2_POLY holds the coefficients (tests/test_fastmath.py checks the
same arithmetic in numpy).
"""

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# p(f) = sum EXP2_POLY[k] f^k ~ 2^f on [-0.5, 0.5]
EXP2_POLY = (1.0000001192092896, 0.6931469440460205, 0.24022120237350464, 0.05550713464617729,
             0.00967553723603487, 0.001327644451521337)
EXP2_FLOOR = -125.0  # inputs below it give 0
EXP2_CEIL = 127.0  # inputs must not exceed it (no clamp: a register more at G = 4 spills); the KL pass's are <= 0
_MAGIC = 12582912.0  # 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits


def _f32_hex(v: float) -> str:
    import struct

    return "0f" + struct.pack(">f", v).hex().upper()


def _asm() -> str:
    c = [_f32_hex(v) for v in EXP2_POLY]
    magic, floor = _f32_hex(_MAGIC), _f32_hex(EXP2_FLOOR)
    return "\n\t".join([
        "{",
        ".reg .f32 xc, t, n, f, p;",
        ".reg .b32 ti, pi, r;",
        ".reg .pred low, nan;",
        f"max.f32 xc, $1, {floor};",
        f"add.rn.f32 t, xc, {magic};",  # n + 1.5 * 2^23, n = round(xc)
        f"sub.rn.f32 n, t, {magic};",
        "sub.rn.f32 f, xc, n;",
        f"fma.rn.f32 p, {c[5]}, f, {c[4]};",
        f"fma.rn.f32 p, p, f, {c[3]};",
        f"fma.rn.f32 p, p, f, {c[2]};",
        f"fma.rn.f32 p, p, f, {c[1]};",
        f"fma.rn.f32 p, p, f, {c[0]};",
        "mov.b32 ti, t;",
        "shl.b32 ti, ti, 23;",  # n << 23: the magic number's own bits all shift out
        "mov.b32 pi, p;",
        "add.s32 r, pi, ti;",
        f"setp.lt.f32 low, $1, {floor};",
        "setp.nan.f32 nan, $1, $1;",
        "selp.b32 r, 0, r, low;",
        "mov.b32 $0, r;",
        "@nan mov.f32 $0, $1;",
        "}",
    ])


_ASM = _asm()


@dsl_user_op
def exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x computed on the FP32 pipe (module docstring): what cute.math.exp2(x, fastmath=True) gives, within
    its error, without a MUFU instruction."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], _ASM, "=f,f",
                                   has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
