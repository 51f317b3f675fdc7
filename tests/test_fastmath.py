"""kernels_src.fastmath's 2^x, its PTX's arithmetic step by step in float32 numpy (no GPU): relative error
against exp2 over the whole range it returns non-zero values for, exact 0 below the floor and for -inf, NaN kept.
The GPU tests run the PTX itself (tests/test_sparse_fwd_gpu.py::test_kl_pass_with_exponentials_on_the_fp32_pipe)."""

import numpy as np
import pytest

pytest.importorskip("cutlass", reason="kernels_src.fastmath imports cutlass (pip install '.[test]')")

from kernels_src.fastmath import _MAGIC, EXP2_CEIL, EXP2_FLOOR, EXP2_POLY, _asm  # noqa: E402


def exp2_as_the_ptx(x: np.ndarray) -> np.ndarray:
    f32 = np.float32
    x = x.astype(f32)
    xc = np.maximum(x, f32(EXP2_FLOOR))  # max.f32 (NaN gives the other operand)
    xc = np.where(np.isnan(x), f32(EXP2_FLOOR), xc)
    t = (xc + f32(_MAGIC)).astype(f32)
    n = (t - f32(_MAGIC)).astype(f32)
    f = (xc - n).astype(f32)
    c = [f32(v) for v in EXP2_POLY]
    p = np.full_like(f, c[5])
    for k in (4, 3, 2, 1, 0):  # fma.rn: one rounding; float64 then float32 is within one ulp of it
        p = (p.astype(np.float64) * f + c[k]).astype(f32)
    bits = (p.view(np.uint32).astype(np.uint64) + (t.view(np.uint32).astype(np.uint64) << np.uint64(23))) \
        & np.uint64(0xFFFFFFFF)
    r = bits.astype(np.uint32).view(f32)
    r = np.where(x < f32(EXP2_FLOOR), f32(0), r)
    return np.where(np.isnan(x), x, r)


def test_relative_error_matches_mufu():
    x = np.linspace(EXP2_FLOOR, EXP2_CEIL, 4_000_001, dtype=np.float32)
    got = exp2_as_the_ptx(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 3e-7, (rel.max(), x[rel.argmax()])  # ex2.approx.f32: 2^-22 ~ 2.4e-7


def test_edges():
    x = np.array([-np.inf, -1e30, -200.0, EXP2_FLOOR - 0.25, np.nan, 0.0, -0.5, 0.5, 1.0], dtype=np.float32)
    got = exp2_as_the_ptx(x)
    assert (got[:4] == 0).all()  # masked keys and underflow: exactly 0, as the MUFU build's .ftz gives
    assert np.isnan(got[4])
    np.testing.assert_allclose(got[5:], np.exp2(x[5:].astype(np.float64)), rtol=3e-7)


def test_ptx_holds_the_coefficients():
    import struct

    asm = _asm()
    for v in EXP2_POLY:
        assert "0f" + struct.pack(">f", v).hex().upper() in asm
    assert "ex2" not in asm  # no MUFU instruction
