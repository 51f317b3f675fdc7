"""Warmup proxy backward: dq_proxy and dk_proxy of warmup mode over the whole causal prefix (issue 5, item 2).

The warmup KL pass's structure (kernels_src.warmup_kl: query-outer, contiguous tiles, the G + 1 query tiles
resident) with the gradient of the KL (msa-semantics.md, "Proxy KL loss"): per (i, t <= i) of proxy head p,
  dS_p = (pi - tau) * kl_grad[b, p, i],   pi = exp(s_p - lse_p),   tau = (1 / G) sum_g exp(s_g - lse_g),
  dq_proxy[b, i, p] = scale sum_t dS_p k_proxy[t]   (registers across the key tiles: each row lives in one CTA;
                                                     added to fp32 rows once),
  dk_proxy[b, t, pk] += scale sum_i dS_p q_proxy[i] (fp32 atomics per key tile: every query tile meets there).
Configs: wgmma (sm90a) only, G <= 4 query tiles resident; a proxy group of 8 or 16 heads runs as 2 or 4 launches
over chunks of 4 heads (dS_p is linear in tau). Elsewhere warmup keeps the sparse proxy backward over the
all-causal selection (flash_msa_rt.ops.kernels). This module does not import cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, variant_name
from kernels_src.spec import DEFAULT, BuildSpec, family_spec
from kernels_src.warmup_kl import _align, dense_configs, dense_verdict

OP = "warmup_bwd_proxy"
_ELEM_BYTES = {"bf16": 2, "f16": 2}


@dataclass(frozen=True)
class Config:
    dtype: str = "bf16"
    head_dim: int = 128
    group: int = 4
    tile_m: int = 128  # queries per CTA: two warpgroups x 64 rows
    tile_n: int = 64  # keys per step
    threads: int = 256
    # 1: also each row's KL value (kl_rows) from the tau and pi the gradient forms, so deferred KL mode needs only
    # the proxy lse before it (warmup_kl's kl_value = 0), not the whole KL pass; one launch per group only
    kl_value: int = 0

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)

    def smem_bytes(self) -> int:
        """The G + 1 resident query tiles; one K tile (reloaded mid-step, once the main products have read it),
        two K_p tiles; the dS_p tile (bf16) for dk_p; the rows' statistics. Mirrors SharedStorage (1024-aligned)."""
        e = _ELEM_BYTES[self.dtype]
        q = _align((self.group + 1) * self.tile_m * self.head_dim * e, 1024)
        k = _align(self.tile_n * self.head_dim * e, 1024)
        kp = _align(2 * self.tile_n * self.head_dim * e, 1024)
        ds = _align(self.tile_m * self.tile_n * e, 1024)
        rows = self.tile_m * (self.group + 2) * 4  # lse_g, lse_p, kl_grad per row (fp32)
        return _align(q + k + kp + ds + rows, 1024)  # the struct's size is a multiple of its 1024-byte alignment


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """block_sizes: accepted for the catalogue's common signature; the pass has no key blocks. Each variant with and
    without the KL value."""
    return [dataclasses.replace(c, kl_value=kv) for c in dense_configs(Config, head_dims, dtypes) for kv in (0, 1)]


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    return dense_verdict(OP, config, arch, kl_value=(0, 1))


def params(config: Config) -> tuple:
    c = config
    bshd = ("i64", "i64", "i64", 1)
    d = c.head_dim
    rows = ("i64", "i64", 1)
    return (
        TensorParam("q", c.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("k", c.dtype, ("B", "S", "Hk", d), bshd, align=16),
        TensorParam("q_proxy", c.dtype, ("B", "S", "Hp", d), bshd, align=16),
        TensorParam("k_proxy", c.dtype, ("B", "S", "Hpk", d), bshd, align=16),
        TensorParam("lse", "f32", ("B", "H", "S"), rows, align=4),
        TensorParam("lse_proxy", "f32", ("B", "Hp", "S"), rows, align=4),
        TensorParam("kl_grad", "f32", ("B", "Hp", "S"), rows, align=4),
        TensorParam("dqp_acc", "f32", ("B", "S", "Hp", d), bshd, align=16),
        TensorParam("dkp_acc", "f32", ("B", "S", "Hpk", d), bshd, align=16),
        # written by the kl_value = 1 variants only (the others take any (B, Hp, S) f32 tensor and never touch it)
        TensorParam("kl_rows", "f32", ("B", "Hp", "S"), rows, align=4),
        ScalarParam("scale", "f32"),
        ScalarParam("proxy_scale", "f32"),  # the proxy scores' (pi, dq_p, dk_p); scale: the main scores' (tau)
        ScalarParam("hp_per_hk", "i32"),
        ScalarParam("hp_per_hpk", "i32"),
        ScalarParam("group_heads", "i32"),  # H / Hp: a multiple of G (a group runs as group_heads / G launches)
        ScalarParam("head0", "i32"),  # this launch's first head within the group: 0, G, 2 G, ...
    )


def build_set(config: Config, arch: str) -> str:
    """Every variant runs: the proxy backward takes the G heads in chunks of 1, 2 or 4."""
    return DEFAULT


def build_spec(config: Config, arch: str) -> BuildSpec:
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"ceil_div(S, {config.tile_m})", "Hp", "B"),
                       compile_fn="kernels_src.warmup_bwd_proxy.build:compile", smem_bytes=config.smem_bytes())
