"""The CUDA kernel backend: the ops whose AOT kernels are built for the device, registered with dispatch.

Today: selection (flash_msa_rt.ops.select). The attention forward/backward kernels register here as they land;
until then those ops run on the reference and dispatch says so once. A problem a kernel cannot run (dtype, head
dim, block size, K, varlen, or a variant not built for this GPU) is declined with the reason, which dispatch shows
with the build command; a declined call is never an error.
"""

from __future__ import annotations

import torch

from flash_msa_rt.errors import FlashMsaError
from flash_msa_rt.ops import dispatch, select

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}


def _select_supports(problem: dispatch.Problem) -> str | None:
    c = problem.config
    if c.get("varlen"):
        return "the selection kernel does not take cu_seqlens yet"
    if problem.dtype not in _DTYPE_NAMES:
        return f"dtype {problem.dtype} (selection kernel: bfloat16, float16)"
    dp, bs, k = c.get("proxy_head_dim"), c.get("block_size"), c.get("top_k_blocks")
    if dp not in select.HEAD_DIMS or bs not in select.BLOCK_SIZES or k > max(select.SHIPPED_MAX_KS):
        return (f"proxy head dim {dp}, block_size {bs}, K {k} (selection kernel: head dim {select.HEAD_DIMS}, "
                f"block_size {select.BLOCK_SIZES}, K <= {max(select.SHIPPED_MAX_KS)})")
    from flash_msa_rt import artifacts
    from flash_msa_rt.loader import device_arch

    index = problem.device.index if problem.device.index is not None else torch.cuda.current_device()
    config = select.kernel_config(_DTYPE_NAMES[problem.dtype], dp, bs, select.max_k_for(k))
    try:
        artifacts.find_variant("select", config, device_arch(index))
    except FlashMsaError as e:
        return str(e)
    return None


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA wants a unit-stride head dim and 16-byte multiples elsewhere; other views are copied once."""
    ok = t.stride(-1) == 1 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]) \
        and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()


def _select_blocks(q_proxy, k_proxy, top_k_blocks, block_size, scale, cu_seqlens=None):
    if -(-q_proxy.shape[1] // block_size) >= select.MAX_BLOCKS:  # int16 block slots: beyond 4M tokens
        return dispatch.reference_impl("select_blocks")(q_proxy, k_proxy, top_k_blocks, block_size, scale,
                                                        cu_seqlens)
    return select.select_blocks_cuda(_tma_ready(q_proxy), _tma_ready(k_proxy), top_k_blocks, block_size, scale)


KERNELS = dispatch.Backend(
    name="kernels", device_type="cuda",
    supports=lambda problem: _select_supports(problem) if problem.op == "select_blocks"
    else "its kernel is not built yet (issue 4)",
    ops={"select_blocks": _select_blocks},
)
