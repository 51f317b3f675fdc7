"""Warmup mode's KL pass on the dense kernel (kernels_src.warmup_kl): lse_proxy and kl_rows over every causal key.

Warmup selects every causal block, so each query's keys are the contiguous prefix [0, i]: the kernel walks it
query-outer over contiguous tiles, with no reverse-index plan, no gathered rows and no per-slot partials (the
sparse KL pass over the all-causal selection, sparse_fwd.msa_kl_cuda, needs all three). One launch, no host
synchronisation, no workspace beyond the two (B, Hp, S) outputs.
Built for sm90a (wgmma) at G = H / Hp in GROUPS; elsewhere `usable` says why not and warmup keeps the sparse pass.
"""

from __future__ import annotations

import torch

from flash_msa_rt.errors import FlashMsaError
from flash_msa_rt.loader import get_kernel

DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
HEAD_DIMS = (128,)
GROUPS = (1, 2, 4)  # the G + 1 query tiles of a CTA stay in shared memory (kernels_src.warmup_kl)


def kernel_config(dtype: str, head_dim: int, group: int) -> dict:
    """The variant launched; fields in the order the build names them."""
    return {"dtype": dtype, "head_dim": head_dim, "group": group, "tile_m": 128, "tile_n": 64, "threads": 256,
            "stages": 2}


def usable(q_proxy: torch.Tensor, q: torch.Tensor) -> str | None:
    """None when the dense KL pass runs this problem on q's device, else why not (then the sparse pass runs)."""
    from flash_msa_rt import artifacts
    from flash_msa_rt.loader import device_arch

    D, Dp, G = q.shape[3], q_proxy.shape[3], q.shape[2] // q_proxy.shape[2]
    if q.dtype not in DTYPES or D not in HEAD_DIMS or Dp != D or G not in GROUPS:
        return f"dtype {q.dtype}, D {D}, Dp {Dp}, G {G} (warmup_kl: bf16 / fp16, D = Dp in {HEAD_DIMS}, G in {GROUPS})"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    arch = device_arch(index)
    if arch != "sm90a":
        return f"warmup_kl is built for sm90a only, not {arch}"
    try:
        artifacts.find_variant("warmup_kl", kernel_config(DTYPES[q.dtype], D, G), arch)
    except FlashMsaError as e:
        return str(e)
    return None


def warmup_kl_cuda(q_proxy, k_proxy, q, k, lse, scale):
    """(lse_proxy (B, Hp, S), kl_rows (B, Hp, S)) of warmup mode given the main attention's final lse (B, H, S).
    Inputs in the internal layout (B, S, heads, D), 16-byte aligned rows with a unit-stride head dim."""
    B, S, H, D = q.shape
    Hp = q_proxy.shape[2]
    lse_proxy = torch.empty((B, Hp, S), dtype=torch.float32, device=q.device)
    kl_rows = torch.empty((B, Hp, S), dtype=torch.float32, device=q.device)
    if B == 0 or S == 0:
        return lse_proxy, kl_rows
    kernel = get_kernel("warmup_kl", kernel_config(DTYPES[q.dtype], D, H // Hp), q.device)
    kernel(q=q, k=k, q_proxy=q_proxy, k_proxy=k_proxy, lse=lse.contiguous(), lse_proxy=lse_proxy, kl_rows=kl_rows,
           scale=float(scale), hp_per_hk=Hp // k.shape[2], hp_per_hpk=Hp // k_proxy.shape[2])
    return lse_proxy, kl_rows
