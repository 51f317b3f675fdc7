"""Reference block selection Sel_p(i) (docs/msa-semantics.md, "Selection")."""

from __future__ import annotations

import torch

from flash_msa_rt.reference import attention, checks, fp8
from flash_msa_rt.reference.block_scores import block_scores_of_rows
from flash_msa_rt.reference.numerics import _ieee_fp32_matmul, compute_dtype

_FN = "select_blocks"
PRECISIONS = ("bf16", "fp8")


def select_blocks(q_proxy: torch.Tensor, k_proxy: torch.Tensor, top_k_blocks: int, block_size: int,
                  scale: float, precision: str = "bf16", local_blocks: int = 1) -> torch.Tensor:
    """Selected key blocks, int32 (B, Hp, S, K) with K = top_k_blocks.

    Row i of proxy head p holds its forced blocks F(i) = {blk(i), ..., blk(i) - L + 1} (those >= 0; L =
    local_blocks, 1 <= L <= K) plus the K - |F(i)| earlier blocks j < blk(i) - L + 1 with the largest block score
    c_p(i, j) (the max of the causal token scores in the block); ties go to the smaller block index. scale is the
    proxy scale: any positive value ranks alike (up to rounding).
    Slots are ascending with the empty ones (-1) last; K may exceed the number of blocks.

    q_proxy (B, S, Hp, Dp), k_proxy (B, S_k, Hpk, Dp) with S_k >= S (usually S_k = S): query row i sits at key
    position S_k - S + i (bottom-right causal alignment) and its local block is that position // block_size.
    Proxy head p reads key head p // (Hp / Hpk). Scores are
    float32 (float64 for float64 inputs); query rows are processed in chunks, each scoring only its causal
    prefix, and ranked per chunk, so neither (B, Hp, S, S) nor (B, Hp, S, NB) is materialised at once.

    precision "fp8": the scores are those of flash_msa_rt.reference.fp8 (q_proxy per row and k_proxy per key block
    in e4m3 with power-of-two scales, products and sums in float32), ranked by the same rule.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"{_FN}: precision {precision!r} is not supported; supported: {', '.join(PRECISIONS)}")
    B, S = q_proxy.shape[:2] if isinstance(q_proxy, torch.Tensor) else (0, 0)
    S_k = k_proxy.shape[1] if isinstance(k_proxy, torch.Tensor) and k_proxy.dim() == 4 else S
    checks.proxy_dims(_FN, q_proxy, k_proxy, B, S, None, S_k if S_k >= S else S)
    if S < 1:
        raise ValueError(f"{_FN}: S = {S} must be positive (varlen references accept empty sequences)")
    K = checks.top_k_blocks(_FN, top_k_blocks)
    L = checks.local_blocks(_FN, local_blocks, K)
    Bs = checks.block_size(_FN, block_size)
    scale = checks.scale(_FN, scale)
    _, _, Hp, Dp = q_proxy.shape
    Hpk = k_proxy.shape[2]
    dt = compute_dtype(q_proxy, k_proxy)
    q_scale = k_scale = None
    if precision == "fp8":
        (q_proxy, q_scale), (k_proxy, k_scale) = fp8.quantize_rows(q_proxy), fp8.quantize_key_blocks(k_proxy, Bs)
        q_scale = q_scale.permute(0, 2, 1).unsqueeze(-1)  # (B, Hp, S, 1)
        k_scale = k_scale.permute(0, 2, 1).repeat_interleave(Hp // Hpk, dim=1).unsqueeze(2)  # (B, Hp, 1, NB)
        dt = torch.promote_types(dt, torch.float32)
    # (B, Hpk, G, S, Dp) and (B, Hpk, 1, Dp, S): proxy head p = pk * G + g reads key head pk by broadcasting.
    q = q_proxy.to(dt).permute(0, 2, 1, 3).reshape(B, Hpk, Hp // Hpk, S, Dp)
    kt = k_proxy.to(dt).permute(0, 2, 3, 1).unsqueeze(2)

    selected = torch.full((B, Hp, S, K), -1, dtype=torch.int32, device=q_proxy.device)
    with _ieee_fp32_matmul():
        for i0, i1 in attention.row_chunks(S, B * Hp * S_k):
            scores = block_scores_of_rows(q, kt, i0, i1, Bs, scale, S_k - S)  # (B, Hp, rows, nb)
            if precision == "fp8":  # powers of two: exact products, after the scale (the kernel's order)
                scores = scores * k_scale[..., :scores.shape[-1]] * q_scale[:, :, i0:i1]
            selected[:, :, i0:i1] = _top_blocks(scores, S_k - S + i0, S_k - S + i1, K, Bs, L)
    return selected


def _top_blocks(scores: torch.Tensor, i0: int, i1: int, K: int, Bs: int, L: int = 1) -> torch.Tensor:
    """Slots (B, Hp, rows, K) of the rows at key positions [i0, i1) from their block scores (B, Hp, rows, nb):
    the L forced blocks ending at the local one, then the K - L best blocks before them."""
    B, Hp, R, nb = scores.shape
    dev = scores.device
    local = (torch.arange(i0, i1, device=dev) // Bs).view(R, 1)
    first_forced = local - (L - 1)  # may be negative: fewer than L blocks exist, all of them forced
    earlier = torch.arange(nb, device=dev).view(1, nb) < first_forced
    ranked = scores.masked_fill(~earlier, float("-inf"))
    # A stable descending sort keeps equal scores in index order: ties go to the smaller block. Candidates are
    # judged by index, not score, so an earlier block always outranks the masked forced and later blocks.
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :K - L]
    picked = torch.where(order < first_forced, order, torch.full_like(order, -1))
    slots = torch.full((B, Hp, R, K), -1, dtype=torch.long, device=dev)
    forced = local - torch.arange(L, device=dev).view(1, L)  # (R, L): blk(i), blk(i) - 1, ...
    slots[..., :L] = torch.where(forced >= 0, forced, torch.full_like(forced, -1))
    slots[..., L:L + picked.shape[-1]] = picked
    # Ascending with -1 last.
    big = torch.iinfo(torch.long).max
    slots = torch.where(slots < 0, torch.full_like(slots, big), slots).sort(dim=-1).values
    return torch.where(slots == big, torch.full_like(slots, -1), slots).to(torch.int32)
