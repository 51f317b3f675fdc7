"""Reference proxy block scores c_p(i, j) (docs/msa-semantics.md, "Selection"). Torch only, no cutlass.

Slow on purpose and meant for tests: every score is computed in float32 (or the dtype asked for) from the inputs
upcast, in an order unrelated to the kernels'.
"""

from __future__ import annotations

import torch

from flash_msa_rt.reference.numerics import _ieee_fp32_matmul

# Rows of scores materialised at once: a query chunk costs B * Hp * rows * keys floats.
_CHUNK_ELEMS = 1 << 25


def proxy_block_scores(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    block_size: int,
    scale: float,
    *,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Block scores (B, Hp, S, NB) float32, NB = ceil(S / block_size).

    scores[b, p, i, j] = max over keys t in [j * Bs, (j + 1) * Bs) with t <= i of
    scale * <q_proxy[b, i, p, :], k_proxy[b, t, p // (Hp // Hpk), :]>, and -inf for every j > i // Bs.

    q_proxy: (B, S, Hp, Dp); k_proxy: (B, S, Hpk, Dp); Hp a multiple of Hpk. Computed in compute_dtype, by default
    float32 (float64 when the inputs are float64), TF32 disabled on CUDA, over chunks of query rows, each against
    only the keys it can see, so S = 8K does not allocate S * S * Hp floats. The result is float32 either way.
    """
    _check(q_proxy, k_proxy, block_size, scale)
    B, S, Hp, Dp = q_proxy.shape
    Hpk = k_proxy.shape[2]
    G = Hp // Hpk
    Bs = int(block_size)
    if compute_dtype is None:
        compute_dtype = torch.promote_types(q_proxy.dtype, torch.float32)
    NB = -(-S // Bs)

    # (B, Hpk, G, S, Dp) and (B, Hpk, 1, Dp, S): each proxy head p = pk * G + g reads key head pk by broadcasting.
    q = q_proxy.to(compute_dtype).permute(0, 2, 1, 3).reshape(B, Hpk, G, S, Dp)
    kt = k_proxy.to(compute_dtype).permute(0, 2, 3, 1).unsqueeze(2)

    out = torch.full((B, Hp, S, NB), float("-inf"), dtype=torch.float32, device=q_proxy.device)
    rows = max(1, min(S, _CHUNK_ELEMS // (B * Hp * S)))
    with _ieee_fp32_matmul():
        for i0 in range(0, S, rows):
            i1 = min(S, i0 + rows)
            s = block_scores_of_rows(q, kt, i0, i1, Bs, scale)
            out[:, :, i0:i1, :s.shape[-1]] = s.to(torch.float32)
    return out


def block_scores_of_rows(q: torch.Tensor, kt: torch.Tensor, i0: int, i1: int, block_size: int,
                         scale: float, offset: int = 0) -> torch.Tensor:
    """Block scores of query rows [i0, i1): (B, Hp, rows, nb) in q's dtype, nb = blocks those rows can see.

    q: (B, Hpk, G, S, Dp) proxy queries grouped by key head; kt: (B, Hpk, 1, Dp, S_k) proxy keys transposed;
    query row i sits at key position offset + i (offset = S_k - S, 0 unless keys outnumber queries).
    Only the causal prefix [0, nb * Bs) is scored, so the cost is rows * keys, never S * S.
    """
    B, Hpk, G = q.shape[:3]
    S = kt.shape[-1]
    Bs = block_size
    nb = -(-(offset + i1) // Bs)  # blocks any row of the chunk can see
    t1 = min(S, nb * Bs)
    s = torch.matmul(q[:, :, :, i0:i1], kt[..., :t1]) * scale  # (B, Hpk, G, rows, t1)
    i = torch.arange(offset + i0, offset + i1, device=s.device).view(-1, 1)
    t = torch.arange(0, t1, device=s.device).view(1, -1)
    s = s.masked_fill(t > i, float("-inf"))
    if t1 < nb * Bs:  # partial last block: pad with -inf keys (never visible: t >= S > i)
        s = torch.nn.functional.pad(s, (0, nb * Bs - t1), value=float("-inf"))
    return s.reshape(B, Hpk * G, i1 - i0, nb, Bs).amax(dim=-1)


def _check(q_proxy, k_proxy, block_size, scale) -> None:
    for name, t in (("q_proxy", q_proxy), ("k_proxy", k_proxy)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"proxy_block_scores: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"proxy_block_scores: {name} must be (B, S, heads, Dp), got shape {tuple(t.shape)}")
    B, S, Hp, Dp = q_proxy.shape
    if (k_proxy.shape[0], k_proxy.shape[1], k_proxy.shape[3]) != (B, S, Dp):
        raise ValueError(f"proxy_block_scores: k_proxy shape {tuple(k_proxy.shape)} does not match q_proxy "
                         f"{tuple(q_proxy.shape)} in B, S or Dp")
    Hpk = k_proxy.shape[2]
    if Hpk < 1 or Hp % Hpk:
        raise ValueError(f"proxy_block_scores: Hp = {Hp} must be a positive multiple of Hpk = {Hpk}")
    if S < 1:
        raise ValueError(f"proxy_block_scores: S = {S} must be positive")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"proxy_block_scores: block_size must be a positive int, got {block_size!r}")
    if not float(scale) > 0:
        raise ValueError(f"proxy_block_scores: scale must be > 0, got {scale!r}")
