"""Warmup KL pass: the true KL and the proxy lse of warmup mode over the whole causal prefix (issue 5, item 1).

Warmup mode is MSA with every causal key selected (msa-semantics.md, "Warmup mode"), so every query's keys are the
contiguous range [0, i]: this pass is query-outer over contiguous tiles, with no plan, no gathered rows and no
per-slot partials to merge. One CTA per (query tile of 128 rows, proxy head p, batch b), longest tiles first; the
G main heads' and the proxy's query tiles stay in shared memory while the key tiles stream, and each row's
(lse_p, KL) is finished in registers and written once (deterministic). kernel.py says how.

Given the main attention's final lse (cuDNN's, in warmup mode), per row i of proxy head p:
  tau(t) = (1 / G) sum_g exp(s_g(i, t) - lse_g(i)),  lse_p(i) = logsumexp_t s_p(i, t),
  KL_p(i) = sum_t tau (ln tau - s_p + lse_p)  over t <= i.
Configs: wgmma (sm90a) only, G <= 4 (the G + 1 resident query tiles take 32 KB each); other groups and arches
run the sparse KL pass over the all-causal selection (flash_msa_rt.ops.kernels). This module does not import
cutlass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flash_msa_rt.manifest import ScalarParam, TensorParam, variant_name
from kernels_src import matrix
from kernels_src.spec import DEFAULT, OPT_IN, BuildSpec, family_spec, refusal, smem_refusal, verdict

OP = "warmup_kl"

DTYPES = ("bf16", "f16")
GROUPS = (1, 2, 4)
_ELEM_BYTES = {"bf16": 2, "f16": 2}


@dataclass(frozen=True)
class Config:
    dtype: str = "bf16"
    head_dim: int = 128
    group: int = 4
    tile_m: int = 128  # queries per CTA: two warpgroups x 64 rows
    tile_n: int = 64  # keys per step (K and K_p tiles, double buffered)
    threads: int = 256  # 2 warpgroups; "pingpong": 288, the producer warp beside them
    stages: int = 2
    # "lockstep" (kernel.py): every thread loads and both warpgroups pass each step's barriers together;
    # "pingpong" (pingpong.py): a producer warp streams the key tiles through mbarriers and the warpgroups take turns
    schedule: str = "lockstep"
    # 1: lse_p and the KL value; 0: the proxy lse alone (lse.py; deferred KL mode, whose backward forms the value),
    # which reads no main head, so it is built at group 1 only and serves every G
    kl_value: int = 1

    def variant_name(self, arch: str) -> str:
        return variant_name(OP, dataclasses.asdict(self), arch)

    def smem_bytes(self) -> int:
        """The G + 1 resident query tiles (main heads, then the proxy head); K and K_p tiles per stage; for
        "pingpong", the mbarriers and the lse table first (padded to the tiles' 1024-byte alignment). Mirrors
        SharedStorage."""
        e = _ELEM_BYTES[self.dtype]
        if not self.kl_value:  # the mbarriers, q_proxy's tile, the K_p ring
            return _align(2 * self.stages * 8, 1024) + _align(self.tile_m * self.head_dim * e, 1024) + \
                _align(self.stages * self.tile_n * self.head_dim * e, 1024)
        # full / empty mbarriers and the (tile_m, G) fp32 lse table, before the 1024-aligned tiles
        barriers = _align(2 * self.stages * 8 + 4 * self.tile_m * self.group, 1024) if self.schedule == "pingpong" \
            else 0
        q = _align((self.group + 1) * self.tile_m * self.head_dim * e, 1024)
        kv = 2 * _align(self.stages * self.tile_n * self.head_dim * e, 1024)
        return barriers + q + kv


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def dense_configs(config_cls, head_dims=None, dtypes=None) -> list:
    """The default variants of a dense warmup family (this one and warmup_bwd_proxy): every dtype, head dim and G."""
    dts = tuple(dtypes) if dtypes else DTYPES
    ds = matrix.head_dims(head_dims)
    return [config_cls(dtype=dt, head_dim=d, group=g) for dt in dts for d in ds for g in GROUPS]


def dense_verdict(op: str, config, arch: str, threads=(256,), **fields) -> tuple[bool, str]:
    """can_implement of a dense warmup family: its fixed tile fields (plus `fields`), wgmma on sm90a only, and the
    shared memory the G + 1 resident query tiles take."""
    reason = refusal(config, arch, {"group": "G + 1 query tiles of 32 KB stay in shared memory"}, dtype=DTYPES,
                     head_dim=matrix.HEAD_DIMS, group=GROUPS, tile_m=(128,), tile_n=(64,), threads=threads, **fields)
    if reason is None and arch != "sm90a":
        reason = f"{op} runs on Hopper's warpgroup MMA: sm90a only, not {arch}"
    return verdict(reason or smem_refusal(config.smem_bytes(), arch))


SCHEDULE_THREADS = {"lockstep": 256, "pingpong": 288}


def configs(head_dims=None, block_sizes=None, dtypes=None) -> list[Config]:
    """block_sizes: accepted for the catalogue's common signature; the pass has no key blocks. Each variant in
    both schedules, and the proxy lse alone (ping-pong, group 1) per dtype and head dim."""
    full = [dataclasses.replace(c, schedule=sc, threads=n) for c in dense_configs(Config, head_dims, dtypes)
            for sc, n in SCHEDULE_THREADS.items()]
    lse_only = [dataclasses.replace(c, schedule="pingpong", threads=SCHEDULE_THREADS["pingpong"], kl_value=0)
                for c in full if c.group == 1 and c.schedule == "lockstep"]
    return full + lse_only


def can_implement(config: Config, arch: str) -> tuple[bool, str]:
    n = SCHEDULE_THREADS.get(config.schedule)
    if n is None:
        return verdict(f"schedule {config.schedule!r} not supported; supported: "
                       f"{', '.join(map(repr, SCHEDULE_THREADS))}")
    if not config.kl_value and (config.group != 1 or config.schedule != "pingpong"):
        return verdict(f"kl_value 0 (the proxy lse alone) is built at group 1, schedule 'pingpong' only, not group "
                       f"{config.group}, schedule {config.schedule!r}: it reads no main head")
    return dense_verdict(OP, config, arch, threads=(n,), stages=(2,), kl_value=(0, 1))


def params(config: Config) -> tuple:
    c = config
    bshd = ("i64", "i64", "i64", 1)
    d = c.head_dim
    if not c.kl_value:  # the proxy lse alone reads the proxy only
        return (
            TensorParam("q_proxy", c.dtype, ("B", "S", "Hp", d), bshd, align=16),
            TensorParam("k_proxy", c.dtype, ("B", "S", "Hpk", d), bshd, align=16),
            TensorParam("lse_proxy", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4),
            ScalarParam("proxy_scale", "f32"),  # the proxy scores' (the only ones read here)
            ScalarParam("hp_per_hpk", "i32"),
        )
    return (
        TensorParam("q", c.dtype, ("B", "S", "H", d), bshd, align=16),
        TensorParam("k", c.dtype, ("B", "S", "Hk", d), bshd, align=16),
        TensorParam("q_proxy", c.dtype, ("B", "S", "Hp", d), bshd, align=16),
        TensorParam("k_proxy", c.dtype, ("B", "S", "Hpk", d), bshd, align=16),
        TensorParam("lse", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4),
        TensorParam("lse_proxy", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4),
        TensorParam("kl_rows", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4),
        ScalarParam("scale", "f32"),  # the main scores' (tau)
        ScalarParam("proxy_scale", "f32"),  # the proxy scores'
        ScalarParam("hp_per_hk", "i32"),
        ScalarParam("hp_per_hpk", "i32"),
    )


def build_set(config: Config, arch: str) -> str:
    """The dense warmup KL pass (and the proxy lse alone) runs in ping-pong (a producer warp streams the key
    tiles); lockstep is kept for A/B runs."""
    return DEFAULT if config.schedule == "pingpong" else OPT_IN


def build_spec(config: Config, arch: str) -> BuildSpec:
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=(f"ceil_div(S, {config.tile_m})", "Hp", "B"),
                       compile_fn="kernels_src.warmup_kl.build:compile", smem_bytes=config.smem_bytes())
