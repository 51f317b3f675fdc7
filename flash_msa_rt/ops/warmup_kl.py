"""Warmup mode's proxy kernels over every causal key, dense: the KL pass (kernels_src.warmup_kl: lse_proxy and
kl_rows), the proxy lse alone (its kl_value = 0 variant) and the proxy backward (kernels_src.warmup_bwd_proxy:
dq_proxy, dk_proxy, and with kl_value = 1 the KL value too).

Deferred KL mode runs the proxy lse alone and then the backward that forms the KL value from the tau and pi it
computes anyway: at (b) 64K this replaces the KL pass (~100 ms, the G main heads' products again) by ~1 / 5 of its
work.

Warmup selects every causal block, so each query's keys are the contiguous prefix [0, i]: the kernel walks it
query-outer over contiguous tiles, with no reverse-index plan, no gathered rows and no per-slot partials (the
sparse kernels over the all-causal selection, sparse_fwd.msa_kl_cuda and sparse_bwd.proxy_backward_cuda, need all
three). No host synchronisation; the only workspace is the fp32 accumulators of dq_proxy and dk_proxy.
Built for sm90a (wgmma): the KL pass at the groups its manifest lists, the proxy backward at those and their
multiples; elsewhere `usable` says why not and warmup keeps the sparse kernels.
"""

from __future__ import annotations

import functools

import torch

from flash_msa_rt.errors import FlashMsaError
from flash_msa_rt.loader import built_values, get_kernel
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.ops.grad_cast import cast_like
from flash_msa_rt.tuning import warmup as tuning_warmup
from flash_msa_rt.tuning.warmup import KL_SCHEDULE_THREADS, WarmupTuning

DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}


def kernel_config(dtype: str, head_dim: int, group: int, schedule: str) -> dict:
    """The KL pass's variant; schedule: the tuning policy's kl_schedule (tuning.warmup)."""
    return {"dtype": dtype, "head_dim": head_dim, "group": group, "tile_m": 128, "tile_n": 64,
            "threads": KL_SCHEDULE_THREADS[schedule], "stages": 2, "schedule": schedule, "kl_value": 1}


def lse_config(dtype: str, head_dim: int) -> dict:
    """The proxy lse alone: it reads no main head, so one variant (group 1) serves every G."""
    return {"dtype": dtype, "head_dim": head_dim, "group": 1, "tile_m": 128, "tile_n": 64,
            "threads": KL_SCHEDULE_THREADS["pingpong"], "stages": 2, "schedule": "pingpong", "kl_value": 0}


def backward_config(dtype: str, head_dim: int, group: int, kl_value: int = 0) -> dict:
    """The proxy backward's variant; kl_value 1: it also writes each row's KL value."""
    return {"dtype": dtype, "head_dim": head_dim, "group": group, "tile_m": 128, "tile_n": 64, "threads": 256,
            "kl_value": kl_value}


def backward_chunk(group: int, t: WarmupTuning) -> int:
    """Heads per launch of the proxy backward for a proxy group of `group` heads: G = 8 and 16 run as G / 4
    launches of the G = 4 variant over chunks of the group's heads (dS_p = (pi - tau) kl_grad is linear in tau, so
    the chunks' gradients add up; the KL value is not, so the KL pass runs only the groups built for it)."""
    return min(group, t.backward_chunk)


def usable(q_proxy: torch.Tensor, q: torch.Tensor, op: str = "warmup_kl") -> str | None:
    """None when the dense kernel of op runs this problem on q's device, else why not (then the sparse kernels, or
    for the last two the KL pass, run it). op: warmup_kl (the KL pass), warmup_bwd_proxy (the proxy backward),
    warmup_lse (the proxy lse alone) or warmup_bwd_proxy_kl (the proxy backward writing the KL value: one launch
    per group, so G <= the backward's chunk). Every warmup forward and backward asks: the arch and artifact lookup
    is made once per (op, variant, device)."""
    D, Dp, G = q.shape[3], q_proxy.shape[3], q.shape[2] // q_proxy.shape[2]
    if q.dtype not in DTYPES or Dp != D:
        return f"dtype {q.dtype}, D {D}, Dp {Dp} ({op}: bf16 / fp16, D = Dp)"
    if q.device.type != "cuda":
        return f"q is on {q.device}: {op} runs on CUDA devices"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    t = tuning_warmup.choose(arch_of(q.device))
    if op == "warmup_kl":
        return _built(op, DTYPES[q.dtype], D, G, t.kl_schedule, index)
    if op == "warmup_lse":
        return _built(op, DTYPES[q.dtype], D, 1, "pingpong", index)
    chunk = backward_chunk(G, t)
    if op == "warmup_bwd_proxy_kl" and chunk != G:
        return f"G {G} runs as {G // max(chunk, 1)} launches of G = {chunk}: the KL value needs a group's whole tau"
    if G % chunk:
        return f"G {G} ({op}: G <= {t.backward_chunk}, or a multiple of it)"
    return _built(op, DTYPES[q.dtype], D, chunk, "", index)


@functools.lru_cache(maxsize=None)
def _built(op: str, dtype: str, D: int, group: int, schedule: str, index: int) -> str | None:
    """None when op's variant (usable's op names) is in the artifacts for device `index`'s arch, else why not
    (naming what is built there)."""
    from flash_msa_rt.loader import device_arch, find_variant

    arch = device_arch(index)
    config = {"warmup_kl": lambda: kernel_config(dtype, D, group, schedule),
              "warmup_lse": lambda: lse_config(dtype, D),
              "warmup_bwd_proxy": lambda: backward_config(dtype, D, group),
              "warmup_bwd_proxy_kl": lambda: backward_config(dtype, D, group, 1)}[op]()
    op = {"warmup_lse": "warmup_kl", "warmup_bwd_proxy_kl": "warmup_bwd_proxy"}.get(op, op)
    try:
        find_variant(op, config, arch)
    except FlashMsaError as e:
        groups = built_values(op, "group", arch, dtype=dtype, head_dim=D)
        if not groups:
            return f"{op} is not built for {arch} ({e})"
        return f"D {D}, G {group}: {op} is built for {arch} at G in {groups}, D in " \
               f"{built_values(op, 'head_dim', arch, dtype=dtype)} ({e})"
    return None


def warmup_kl_cuda(q_proxy, k_proxy, q, k, lse, scale, proxy_scale=None):
    """(lse_proxy (B, Hp, S), kl_rows (B, Hp, S)) of warmup mode given the main attention's final lse (B, H, S).
    Inputs in the internal layout (B, S, heads, D), 16-byte aligned rows with a unit-stride head dim. scale: the
    main scores' (tau); proxy_scale: the proxy scores' (None: scale)."""
    B, S, H, D = q.shape
    Hp = q_proxy.shape[2]
    lse_proxy = torch.empty((B, Hp, S), dtype=torch.float32, device=q.device)
    kl_rows = torch.empty((B, Hp, S), dtype=torch.float32, device=q.device)
    if B == 0 or S == 0:
        return lse_proxy, kl_rows
    t = tuning_warmup.choose(arch_of(q.device))
    kernel = get_kernel("warmup_kl", kernel_config(DTYPES[q.dtype], D, H // Hp, t.kl_schedule), q.device)
    kernel(q=q, k=k, q_proxy=q_proxy, k_proxy=k_proxy, lse=lse.contiguous(), lse_proxy=lse_proxy, kl_rows=kl_rows,
           scale=float(scale), proxy_scale=_proxy_scale(scale, proxy_scale), hp_per_hk=Hp // k.shape[2],
           hp_per_hpk=Hp // k_proxy.shape[2])
    return lse_proxy, kl_rows


def _proxy_scale(scale, proxy_scale) -> float:
    return float(scale if proxy_scale is None else proxy_scale)


def warmup_lse_cuda(q_proxy, k_proxy, proxy_scale):
    """lse_proxy (B, Hp, S) of warmup mode alone (the KL pass's lse_proxy, bit for bit: the same row statistics over
    the same tiles), the proxy scores at proxy_scale. Inputs as warmup_kl_cuda's."""
    B, S, Hp, D = q_proxy.shape
    lse_proxy = torch.empty((B, Hp, S), dtype=torch.float32, device=q_proxy.device)
    if B == 0 or S == 0:
        return lse_proxy
    kernel = get_kernel("warmup_kl", lse_config(DTYPES[q_proxy.dtype], D), q_proxy.device)
    kernel(q_proxy=q_proxy, k_proxy=k_proxy, lse_proxy=lse_proxy, proxy_scale=float(proxy_scale),
           hp_per_hpk=Hp // k_proxy.shape[2])
    return lse_proxy


def warmup_proxy_backward_cuda(q_proxy, k_proxy, q, k, lse, lse_proxy, scale, kl_grad, kl_rows=None, proxy_scale=None):
    """(dq_proxy, dk_proxy) of warmup mode: (pi - tau) * kl_grad over every causal key. kl_grad broadcastable to
    (B, Hp, S); lse (B, H, S) and lse_proxy (B, Hp, S) the forward's. Inputs as warmup_kl_cuda's. kl_rows: a
    (B, Hp, S) f32 tensor that receives each row's KL value (the KL pass's kl_rows), where usable(...,
    "warmup_bwd_proxy_kl") allows it (the caller asks). proxy_scale: the proxy scores' (None: scale)."""
    B, S, H, D = q.shape
    Hp = q_proxy.shape[2]
    G = H // Hp
    dev = q.device
    dqp_acc = torch.zeros(q_proxy.shape, dtype=torch.float32, device=dev)
    dkp_acc = torch.zeros(k_proxy.shape, dtype=torch.float32, device=dev)
    if B > 0 and S > 0:
        grad = torch.broadcast_to(kl_grad.to(device=dev, dtype=torch.float32), (B, Hp, S)).contiguous()
        chunk = backward_chunk(G, tuning_warmup.choose(arch_of(dev)))
        if kl_rows is not None and chunk != G:
            raise ValueError(f"warmup_proxy_backward_cuda: kl_rows needs one launch per group; G {G} runs in chunks "
                             f"of {chunk}")
        kernel = get_kernel("warmup_bwd_proxy", backward_config(DTYPES[q.dtype], D, chunk, int(kl_rows is not None)),
                            dev)
        lse, lse_proxy = lse.contiguous(), lse_proxy.contiguous()
        for head0 in range(0, G, chunk):
            # The kl_value = 0 variant never touches kl_rows: lse_proxy stands in (same shape, no allocation).
            kernel(q=q, k=k, q_proxy=q_proxy, k_proxy=k_proxy, lse=lse, lse_proxy=lse_proxy, kl_grad=grad,
                   dqp_acc=dqp_acc, dkp_acc=dkp_acc, kl_rows=lse_proxy if kl_rows is None else kl_rows,
                   scale=float(scale), proxy_scale=_proxy_scale(scale, proxy_scale), hp_per_hk=Hp // k.shape[2],
                   hp_per_hpk=Hp // k_proxy.shape[2], group_heads=G, head0=head0)
    return cast_like(dqp_acc, q_proxy), cast_like(dkp_acc, k_proxy)
