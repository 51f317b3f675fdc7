"""fp8 selection's quantisation (select_precision="fp8"; docs/msa-semantics.md, "FP8 selection"). Torch only.

The proxy scores that rank key blocks come from q_proxy and k_proxy in float8 e4m3 with float32 scale factors:
  - each query row (b, i, p) of q_proxy has its own scale s_q, each key block (b, j, pk) of k_proxy (its Bs tokens
    by Dp) one scale s_k: a block's keys share the factor its score is multiplied by, so the kernel applies it
    once per block to the block's max rather than once per key;
  - a scale is the smallest power of two s >= 2**-126 with amax / s <= 448 (e4m3's largest finite value), 1 where
    amax is 0. Powers of two make x / s exact before the one rounding to e4m3 and make every product with a scale
    exact, so the kernel's ranking equals this module's scores' ranking up to the MMA's summation order. The floor
    2**-126 keeps 1 / s finite in bfloat16 and float32 (a row that small quantises to zeros either way).
The score of key t for query i is scale * s_q(i) * s_k(blk(t)) * <q8_i, k8_t>, accumulated in float32.

The kernel path quantises with the fp8_quant kernels (flash_msa_rt.ops.fp8_quant: these bytes in one pass per
tensor) or, where tuning.fp8_quant says "torch", with these functions on the GPU: per tensor a min/max pass, a
multiply by 1 / s in the input's dtype where that is exact (bfloat16 shares float32's exponent range; float16 and
float32 inputs multiply in float32) and a contiguous cast to e4m3, about 7 bytes of traffic per bfloat16 q_proxy
element. No host synchronisation either way.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # = 0.875 * 2**9


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 2**e with e >= -126 the smallest integer such that amax <= 448 * 2**e; 1 where amax is 0, amax itself
    where it is not finite (inf or NaN: the row's or block's scores become NaN, as the input is).

    Exact on every device: with amax = m * 2**x (frexp, m in [0.5, 1)), amax <= 0.875 * 2**(9 + e) holds from
    e = x - 9 when m <= 0.875 and from e = x - 8 otherwise, so no log2 rounding enters."""
    amax = amax.float()
    mantissa, exponent = torch.frexp(amax)
    e = torch.clamp(exponent - 9 + (mantissa > 0.875).to(exponent.dtype), min=-126)
    scale = torch.ldexp(torch.ones_like(amax), e)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, amax)


def _abs_max(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """max |x| from min and max (no full-size |x| temporary; NaN propagates)."""
    return torch.maximum(hi.float(), lo.float().neg())


def _to_e4m3(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """x * inv_scale rounded once to e4m3. inv_scale is a power of two in [2**-127, 2**126], so the product is
    exact in bfloat16 (float32's exponent range; a result below its normal range is below e4m3's too) and in
    float32, and the cast is the only rounding. Two plain elementwise kernels: a multiply storing e4m3 directly
    converts in a slower, non-vectorised path."""
    work = x.dtype if x.dtype in (torch.bfloat16, torch.float32, torch.float64) else torch.float32
    return (x.to(work) * inv_scale.to(work)).to(E4M3)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, s): x (B, S, H, D) as e4m3 with one scale per (b, i, h) row; s float32 (B, S, H)."""
    scale = power_of_two_scale(_abs_max(*torch.aminmax(x, dim=-1)))
    return _to_e4m3(x, (1.0 / scale).unsqueeze(-1)), scale


def quantize_key_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, s): x (B, S, H, D) as e4m3 with one scale per (b, key block j, h) of block_size tokens (the last
    block may be partial); s float32 (B, ceil(S / block_size), H), contiguous (the kernel's k_scale)."""
    B, S, H, D = x.shape
    nb = -(-S // block_size)
    full = S // block_size * block_size
    amax = x.new_empty((B, nb, H), dtype=torch.float32)
    if full:
        blocks = x[:, :full].reshape(B, full // block_size, block_size, H, D)
        amax[:, :full // block_size] = _abs_max(blocks.amin(dim=(2, 4)), blocks.amax(dim=(2, 4)))
    if full < S:
        amax[:, nb - 1] = _abs_max(x[:, full:].amin(dim=(1, 3)), x[:, full:].amax(dim=(1, 3)))
    scale = power_of_two_scale(amax)
    inv = (1.0 / scale).repeat_interleave(block_size, dim=1)[:, :S].unsqueeze(-1)
    return _to_e4m3(x, inv), scale.contiguous()
