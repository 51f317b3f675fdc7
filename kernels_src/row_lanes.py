"""Kernels that give each (b, i, h) row of D elements to D / 8 lanes, 16 bytes of a 16-bit row per lane (bwd_delta,
grad_cast): the row arithmetic their family modules share. This module does not import cutlass (the kernels'
side is tiles.RowLanes)."""

ELEMS_PER_LANE = 8  # 16 bytes of a bf16 / fp16 row


def lanes_per_row(config) -> int:
    return config.head_dim // ELEMS_PER_LANE


def rows_per_cta(config) -> int:
    return config.threads // lanes_per_row(config)


def row_grid(config) -> tuple[str, str, str]:
    """The build spec's grid rule: one CTA per rows_per_cta rows of (B, S, H)."""
    return (f"ceil_div(B * S * H, {rows_per_cta(config)})", "1", "1")
