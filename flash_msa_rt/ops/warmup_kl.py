"""Warmup mode's proxy kernels over every causal key, dense: the KL pass (kernels_src.warmup_kl: lse_proxy and
kl_rows) and the proxy backward (kernels_src.warmup_bwd_proxy: dq_proxy, dk_proxy).

Warmup selects every causal block, so each query's keys are the contiguous prefix [0, i]: the kernel walks it
query-outer over contiguous tiles, with no reverse-index plan, no gathered rows and no per-slot partials (the
sparse kernels over the all-causal selection, sparse_fwd.msa_kl_cuda and sparse_bwd.proxy_backward_cuda, need all
three). No host synchronisation; the only workspace is the fp32 accumulators of dq_proxy and dk_proxy.
Built for sm90a (wgmma): the KL pass at G = H / Hp in GROUPS, the proxy backward at BACKWARD_GROUPS; elsewhere
`usable` says why not and warmup keeps the sparse kernels.
"""

from __future__ import annotations

import functools

import torch

from flash_msa_rt.errors import FlashMsaError
from flash_msa_rt.loader import get_kernel

DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
HEAD_DIMS = (128,)
GROUPS = (1, 2, 4)  # the G + 1 query tiles of a CTA stay in shared memory (kernels_src.warmup_kl)
# The proxy backward also runs G = 8 and 16, as G / 4 launches of its G = 4 variant over chunks of the group's
# heads (dS_p = (pi - tau) kl_grad is linear in tau, so the chunks' gradients add up); the KL value is not.
BACKWARD_GROUPS = (1, 2, 4, 8, 16)
BACKWARD_CHUNK = 4


def backward_chunk(group: int) -> int:
    """Heads per launch of the proxy backward for a proxy group of `group` heads."""
    return min(group, BACKWARD_CHUNK)


# The KL pass's schedule (kernels_src/warmup_kl): "pingpong" streams the key tiles from a producer warp through
# mbarriers and lets the two warpgroups take turns (288 threads); "lockstep" loads with every thread and passes
# each step's barriers together (256 threads).
SCHEDULE = "pingpong"
SCHEDULE_THREADS = {"lockstep": 256, "pingpong": 288}


def kernel_config(dtype: str, head_dim: int, group: int, schedule: str | None = None) -> dict:
    """The variant launched; fields in the order the build names them. schedule: SCHEDULE unless given."""
    schedule = schedule or SCHEDULE
    return {"dtype": dtype, "head_dim": head_dim, "group": group, "tile_m": 128, "tile_n": 64,
            "threads": SCHEDULE_THREADS[schedule], "stages": 2, "schedule": schedule}


def backward_config(dtype: str, head_dim: int, group: int) -> dict:
    """The proxy backward's variant; fields in the order the build names them."""
    return {"dtype": dtype, "head_dim": head_dim, "group": group, "tile_m": 128, "tile_n": 64, "threads": 256}


def usable(q_proxy: torch.Tensor, q: torch.Tensor, op: str = "warmup_kl") -> str | None:
    """None when the dense kernel of op (warmup_kl, warmup_bwd_proxy) runs this problem on q's device, else why
    not (then the sparse kernels run it). Every warmup forward and backward asks: the arch and artifact lookup is
    made once per (op, variant, device)."""
    D, Dp, G = q.shape[3], q_proxy.shape[3], q.shape[2] // q_proxy.shape[2]
    groups = GROUPS if op == "warmup_kl" else BACKWARD_GROUPS
    if q.dtype not in DTYPES or D not in HEAD_DIMS or Dp != D or G not in groups:
        return f"dtype {q.dtype}, D {D}, Dp {Dp}, G {G} ({op}: bf16 / fp16, D = Dp in {HEAD_DIMS}, G in {groups})"
    if q.device.type != "cuda":
        return f"q is on {q.device}: {op} runs on CUDA devices"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    group = G if op == "warmup_kl" else backward_chunk(G)
    return _built(op, DTYPES[q.dtype], D, group, index)


@functools.lru_cache(maxsize=None)
def _built(op: str, dtype: str, D: int, group: int, index: int) -> str | None:
    """None when op's variant is in the artifacts for device `index`'s arch (sm90a only), else why not."""
    from flash_msa_rt import artifacts
    from flash_msa_rt.loader import device_arch

    arch = device_arch(index)
    if arch != "sm90a":
        return f"{op} is built for sm90a only, not {arch}"
    config = kernel_config(dtype, D, group) if op == "warmup_kl" else backward_config(dtype, D, group)
    try:
        artifacts.find_variant(op, config, arch)
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


def warmup_proxy_backward_cuda(q_proxy, k_proxy, q, k, lse, lse_proxy, scale, kl_grad):
    """(dq_proxy, dk_proxy) of warmup mode: (pi - tau) * kl_grad over every causal key. kl_grad broadcastable to
    (B, Hp, S); lse (B, H, S) and lse_proxy (B, Hp, S) the forward's. Inputs as warmup_kl_cuda's."""
    B, S, H, D = q.shape
    Hp = q_proxy.shape[2]
    G = H // Hp
    dev = q.device
    dqp_acc = torch.zeros(q_proxy.shape, dtype=torch.float32, device=dev)
    dkp_acc = torch.zeros(k_proxy.shape, dtype=torch.float32, device=dev)
    if B > 0 and S > 0:
        grad = torch.broadcast_to(kl_grad.to(device=dev, dtype=torch.float32), (B, Hp, S)).contiguous()
        chunk = backward_chunk(G)
        kernel = get_kernel("warmup_bwd_proxy", backward_config(DTYPES[q.dtype], D, chunk), dev)
        lse, lse_proxy = lse.contiguous(), lse_proxy.contiguous()
        for head0 in range(0, G, chunk):
            kernel(q=q, k=k, q_proxy=q_proxy, k_proxy=k_proxy, lse=lse, lse_proxy=lse_proxy, kl_grad=grad,
                   dqp_acc=dqp_acc, dkp_acc=dkp_acc, scale=float(scale), hp_per_hk=Hp // k.shape[2],
                   hp_per_hpk=Hp // k_proxy.shape[2], group_heads=G, head0=head0)
    return dqp_acc.to(q_proxy.dtype), dkp_acc.to(k_proxy.dtype)
