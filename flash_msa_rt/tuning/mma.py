"""The MMA instruction each kernel family runs on an arch."""

from __future__ import annotations

FAMILIES = ("block_scores", "select", "sparse_fwd", "sparse_kl", "sparse_bwd", "sparse_bwd_proxy")


def default_mma(arch: str) -> str:
    # wgmma on sm90a, measured per family at (b) S = 64K, B = 2 against mma.sync: sparse_fwd 26.4 -> 23.1 ms,
    # sparse_bwd 67.4 -> 57.0, the KL pass 4.40 -> 2.12 on a 16K-query chunk, select 20.07 -> 15.82. Blackwell has
    # no wgmma (and off CUDA the emulated kernels are mma.sync's): "sync" elsewhere.
    return "wgmma" if arch == "sm90a" else "sync"


def every_mma(kind: str) -> dict:
    """Overrides (for tuning.override) that run every family on `kind` ("sync" | "wgmma")."""
    return {"select": {"mma": kind}, "block_scores": {"mma": kind}, "sparse_fwd": {"mma": kind, "kl_mma": kind},
            "sparse_bwd": {"mma": kind, "proxy_mma": kind}}
