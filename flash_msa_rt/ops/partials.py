"""The per-slot partials of the KV-outer sparse forward and KL pass, and their merges (msa-semantics.md, "Main
sparse attention", "Proxy KL loss").

sparse_fwd writes one partial output row and its lse per (entry, head), the KL pass one (A, T, L) triple per
(entry, key group), each at the entry's destination row e = entry_dest of a plan (flash_msa_rt.ops.sparse_plan).
Here: the buffers' shapes and sizes, and the merges of a row's K partials in torch, the executable statement of the
sparse_combine and sparse_combine_kl kernels (the CPU path, the emulation's combine and the kernels' tests). Like
the plans, everything is shape-static and never synchronises the host with the device.
"""

from __future__ import annotations

import math

import torch

from flash_msa_rt.ops.sparse_plan import SparsePlan, live_slots


# --- partial buffers ---------------------------------------------------------------------------------------------

def kl_groups(block_size: int, tile_n: int = 64) -> int:
    """Key groups of one block whose KL shares the KL pass writes separately: the kernel's key slices of tile_n
    keys (one CTA each) times the two key halves of a slice (two warp columns, or two warpgroups), so
    ceil(Bs / (tile_n / 2))."""
    return -(-block_size // (tile_n // 2))


def partial_shapes(plan: SparsePlan, head_dim: int) -> dict:
    """Shapes of the buffers the kernel passes write, row e = entry_dest of a sorted entry: the forward's o_part and
    lse_part, and the KL pass's (A, T, L) triple per key group (see combine_kl_lse)."""
    E, G = plan.E, plan.group
    return {"o_part": (E, G, head_dim), "lse_part": (E, G), "kl_part": (E, 3 * kl_groups(plan.block_size))}


def partials_bytes(plan: SparsePlan, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of all partial buffers: o_part in dtype (q's), lse_part and kl_part in fp32."""
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    n = {name: math.prod(shape) for name, shape in partial_shapes(plan, head_dim).items()}
    return n["o_part"] * itemsize + 4 * (n["lse_part"] + n["kl_part"])


def empty_forward_partials(plan: SparsePlan, head_dim: int, dtype: torch.dtype, device,
                           stat_dtype: torch.dtype = torch.float32):
    """Uninitialised (o_part (E, G, D) dtype, lse_part (E, G) stat_dtype) for the forward pass."""
    shapes = partial_shapes(plan, head_dim)
    return (torch.empty(shapes["o_part"], dtype=dtype, device=device),
            torch.empty(shapes["lse_part"], dtype=stat_dtype, device=device))


# --- combines ----------------------------------------------------------------------------------------------------

def _check_part(fn: str, name: str, t: torch.Tensor, shape: tuple, float_only: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if float_only and not t.dtype.is_floating_point:
        raise ValueError(f"{fn}: {name} must be floating point, got {t.dtype}")


def _check_indices(fn: str, plan: SparsePlan, block_indices: torch.Tensor) -> None:
    _check_part(fn, "block_indices", block_indices, (plan.B, plan.Hp, plan.S, plan.K), float_only=False)


def _stat_dtype(*parts: torch.Tensor) -> torch.dtype:
    """fp32 statistics (the kernel's), fp64 when an emulation wrote fp64 partials."""
    return torch.float64 if any(t.dtype == torch.float64 for t in parts) else torch.float32


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """lse of a row without live slots is -inf; subtracting 0 keeps exp(-inf - lse) = 0, not NaN. A NaN lse (a NaN
    input reached the row) stays NaN, as the kernels' combines keep it."""
    return torch.where(x == float("-inf"), torch.zeros((), dtype=x.dtype, device=x.device), x)


def combine_forward(plan: SparsePlan, block_indices: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor):
    """Merge the K per-block partials of each (query, head) row.

    o_part (E, G, D), lse_part (E, G), indexed by entry_dest ((b * Hp + p) * S + i) * K + slot.
    lse = logsumexp over live slots of lse_part; out = sum over live slots of exp(lse_part - lse) * o_part (each
    o_part is normalised by its own block's sum).
    -> out (B, S, H, D) in o_part.dtype, lse (B, H, S), h = p * G + g. Statistics and the accumulation are fp32
    (fp64 for fp64 partials). A row without live slots gets out = 0, lse = -inf.
    This combines the whole plan at once, with (E, G, D) fp32 temporaries (the runtime uses the sparse_combine
    kernel; this is its executable statement and the emulation's combine).
    """
    fn = "combine_forward"
    B, Hp, S, K, G = plan.B, plan.Hp, plan.S, plan.K, plan.group
    _check_indices(fn, plan, block_indices)
    if not isinstance(o_part, torch.Tensor) or o_part.dim() != 3:
        raise ValueError(f"{fn}: o_part must be a (E, G, D) tensor, got "
                         f"{tuple(o_part.shape) if isinstance(o_part, torch.Tensor) else type(o_part).__name__}")
    D = o_part.shape[-1]
    _check_part(fn, "o_part", o_part, (plan.E, G, D))
    _check_part(fn, "lse_part", lse_part, (plan.E, G))
    acc = _stat_dtype(o_part, lse_part)
    live = live_slots(block_indices, plan.block_size, plan.key_offset + plan.query_offset)  # (B, Hp, S, K)
    neg_inf = torch.full((), float("-inf"), dtype=acc, device=lse_part.device)
    zero = torch.zeros((), dtype=acc, device=lse_part.device)

    lse_slot = torch.where(live.unsqueeze(-1), lse_part.view(B, Hp, S, K, G).to(acc), neg_inf)
    lse = torch.logsumexp(lse_slot, dim=3)  # (B, Hp, S, G)
    weight = torch.exp(lse_slot - _finite_or_zero(lse).unsqueeze(3))  # 0 on dead slots
    # Dead rows hold garbage (possibly NaN): select, never multiply, them away.
    o = torch.where(live.view(B, Hp, S, K, 1, 1), o_part.view(B, Hp, S, K, G, D).to(acc), zero)
    out = (weight.unsqueeze(-1) * o).sum(dim=3)  # (B, Hp, S, G, D)
    out = out.permute(0, 2, 1, 3, 4).reshape(B, S, Hp * G, D).to(o_part.dtype)
    lse = lse.permute(0, 1, 3, 2).reshape(B, Hp * G, S)
    return out, lse


def combine_kl_lse(plan: SparsePlan, block_indices: torch.Tensor, kl_part: torch.Tensor):
    """(lse_proxy (B, Hp, S), kl_rows (B, Hp, S)) from the KL pass's (A, T, L) triples.

    kl_part (E, 3 * n): per entry and key group, in log2 units over the group's causal keys, A = sum_t tau (log2 tau
    - s_p log2 e), T = sum_t tau and L = log2 sum_t 2^(s_p log2 e), s_p the scaled proxy score. Then lse_proxy =
    logsumexp over the live slots' groups of L ln 2, and, since ln pi = s_p - lse_p,
    KL = sum_t tau (ln tau - ln pi) = ln 2 * sum A + lse_p * sum T (sum T = 1 up to rounding, kept exact).
    A row without live slots gets lse_proxy = -inf and KL = 0. fp32 (fp64 for fp64 parts).
    """
    fn = "combine_kl_lse"
    B, Hp, S, K = plan.B, plan.Hp, plan.S, plan.K
    _check_indices(fn, plan, block_indices)
    if not isinstance(kl_part, torch.Tensor) or kl_part.dim() != 2 or kl_part.shape[1] % 3:
        raise ValueError(f"{fn}: kl_part must be a (E, 3 * groups) tensor of (A, T, L) triples, got "
                         f"{tuple(kl_part.shape) if isinstance(kl_part, torch.Tensor) else type(kl_part).__name__}")
    _check_part(fn, "kl_part", kl_part, (plan.E, kl_part.shape[1]))
    acc = _stat_dtype(kl_part)
    live = live_slots(block_indices, plan.block_size, plan.key_offset + plan.query_offset).view(B, Hp, S, K, 1)
    parts = kl_part.view(B, Hp, S, K, -1, 3).to(acc)
    zero = torch.zeros((), dtype=acc, device=kl_part.device)
    neg_inf = torch.full((), float("-inf"), dtype=acc, device=kl_part.device)
    ln2 = math.log(2.0)
    a = torch.where(live, parts[..., 0], zero).sum(dim=(3, 4))
    t = torch.where(live, parts[..., 1], zero).sum(dim=(3, 4))
    lse_proxy = torch.logsumexp(torch.where(live, parts[..., 2] * ln2, neg_inf).flatten(3), dim=3)
    kl = torch.where(t != 0, ln2 * a + _finite_or_zero(lse_proxy) * t, zero)
    return lse_proxy, kl
