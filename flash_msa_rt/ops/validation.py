"""Argument checks of the public MSA API. Each error names the function, the argument, its value and what works.

TypeError for a wrong kind of object or dtype, ValueError for a wrong shape, device, stride or value. Nothing here
reads a tensor's values except check_cu_seqlens_values (the varlen path, which says so): the fixed-length path
never synchronises the host with the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flash_msa_rt.ops.offsets import host_offsets, host_view

# float64 runs on the reference only (a kernel backend declines it); it is what tests and gradcheck use.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LAYOUTS = {"bhsd": "(batch, heads, seqlen, head_dim)", "bshd": "(batch, seqlen, heads, head_dim)"}
INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True)
class MsaDims:
    """Sizes of one MSA call, read from the (B, S, heads, D) views."""

    B: int
    S: int
    H: int
    Hk: int
    Hp: int
    Hpk: int
    D: int
    Dp: int


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_layout(fn: str, layout) -> None:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout={layout!r} is not supported; supported: "
                         + ", ".join(f"{k!r} {v}" for k, v in LAYOUTS.items()))


def check_tensor(fn: str, name: str, t, ndim: int, dims_text: str) -> None:
    """A floating tensor of `ndim` dims, a supported dtype and a unit-stride head dim."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{fn}: {name} must have {ndim} dims {dims_text}, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: {name} has dtype {t.dtype}; supported: {[str(d) for d in SUPPORTED_DTYPES]}")
    # The kernels load rows of the head dim with vector loads; other strides may be anything (views of a fused
    # projection, transposed layouts).
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must have a unit-stride head dim (last dim), got strides {t.stride()}; "
                         f"call .contiguous() on it")


def check_same_dtype_device(fn: str, tensors: dict) -> None:
    """Every tensor on the device and of the dtype of the first one."""
    (first, ref), *rest = tensors.items()
    for name, t in rest:
        if t.device != ref.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but {first} is on {ref.device}; all inputs must "
                             f"share one device")
        if t.dtype != ref.dtype:
            raise TypeError(f"{fn}: {name} has dtype {t.dtype} but {first} has {ref.dtype}; all inputs must "
                            f"share one dtype")


def check_msa_dims(fn: str, q_proxy, k_proxy, q, k, v, seq_dim_name: str = "seqlen",
                   separate_keys: bool = False) -> MsaDims:
    """Sizes of (B, S, heads, D) views of the five MSA inputs; every disagreement named.

    separate_keys (varlen with cu_seqlens_k): k_proxy, k and v share k's dim 1 (the key tokens), which may differ
    from q's (the query tokens); S is q's.
    """
    B, S, H, D = q.shape
    Hp, Dp = q_proxy.shape[2], q_proxy.shape[3]
    Hk, Hpk = k.shape[2], k_proxy.shape[2]
    S_k, keys_ref = (k.shape[1], "k") if separate_keys else (S, "q")
    for name, t, length, ref in (("q_proxy", q_proxy, S, "q"), ("k_proxy", k_proxy, S_k, keys_ref),
                                 ("k", k, S_k, keys_ref), ("v", v, S_k, keys_ref)):
        if t.shape[0] != B:
            raise ValueError(f"{fn}: {name} has batch {t.shape[0]} but q has batch {B}")
        if t.shape[1] != length:
            raise ValueError(f"{fn}: {name} has {seq_dim_name} {t.shape[1]} but {ref} has {seq_dim_name} {length}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[3] != D:
            raise ValueError(f"{fn}: {name} has head_dim {t.shape[3]} but q has head_dim {D}")
    if v.shape[2] != Hk:
        raise ValueError(f"{fn}: v has {v.shape[2]} heads but k has {Hk}; k and v must have the same heads")
    if k_proxy.shape[3] != Dp:
        raise ValueError(f"{fn}: k_proxy has head_dim {k_proxy.shape[3]} but q_proxy has head_dim {Dp}")
    if S < 1 or S_k < 1:
        raise ValueError(f"{fn}: {seq_dim_name} {min(S, S_k)} must be positive")
    for what, size in (("heads of q", H), ("heads of k", Hk), ("heads of q_proxy", Hp), ("heads of k_proxy", Hpk),
                       ("head_dim of q", D), ("head_dim of q_proxy", Dp)):
        if size < 1:
            raise ValueError(f"{fn}: {what} is {size}; it must be positive")
    if H % Hk:
        raise ValueError(f"{fn}: q has {H} heads, not a multiple of the {Hk} heads of k and v (GQA needs H % Hk == 0)")
    if Hp % Hpk:
        raise ValueError(f"{fn}: q_proxy has {Hp} heads, not a multiple of the {Hpk} heads of k_proxy "
                         f"(Hp % Hpk == 0)")
    if H % Hp:
        raise ValueError(f"{fn}: q has {H} heads, not a multiple of the {Hp} heads of q_proxy (each proxy head "
                         f"serves H / Hp main heads)")
    return MsaDims(B, S, H, Hk, Hp, Hpk, D, Dp)


def check_proxy_dims(fn: str, q_proxy, k_proxy) -> tuple[int, int, int, int, int]:
    """(B, S, Hp, Hpk, Dp) of (B, S, heads, Dp) views of the proxy pair (select_blocks alone)."""
    B, S, Hp, Dp = q_proxy.shape
    Hpk = k_proxy.shape[2]
    for i, what in ((0, "batch"), (1, "seqlen"), (3, "head_dim")):
        if k_proxy.shape[i] != q_proxy.shape[i]:
            raise ValueError(f"{fn}: k_proxy has {what} {k_proxy.shape[i]} but q_proxy has {what} {q_proxy.shape[i]}")
    if S < 1 or Hp < 1 or Hpk < 1 or Dp < 1:
        raise ValueError(f"{fn}: q_proxy and k_proxy must have positive seqlen, heads and head_dim, got "
                         f"{tuple(q_proxy.shape)} and {tuple(k_proxy.shape)} as (batch, seqlen, heads, head_dim)")
    if Hp % Hpk:
        raise ValueError(f"{fn}: q_proxy has {Hp} heads, not a multiple of the {Hpk} heads of k_proxy "
                         f"(Hp % Hpk == 0)")
    return B, S, Hp, Hpk, Dp


def check_block_size(fn: str, block_size) -> int:
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"{fn}: block_size must be a positive int, got {block_size!r} (the kernels build 128 and "
                         f"64; other sizes run on the reference)")
    return block_size


def check_top_k(fn: str, top_k, block_size: int) -> int:
    """K = top_k // block_size selected blocks per query; more than the blocks that exist is allowed."""
    if not _is_int(top_k):
        raise TypeError(f"{fn}: top_k must be an int (tokens), got {type(top_k).__name__} {top_k!r}")
    if top_k < block_size or top_k % block_size:
        raise ValueError(f"{fn}: top_k={top_k} must be a positive multiple of block_size={block_size} "
                         f"(top_k counts tokens: K = top_k // block_size blocks)")
    return top_k // block_size


def resolve_scale(fn: str, scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"{fn}: scale must be a Python float or None (head_dim ** -0.5), got "
                        f"{type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{fn}: scale must be finite and positive, got {scale!r}")
    return float(scale)


def resolve_proxy_scale(fn: str, proxy_scale, scale: float) -> float | None:
    """The proxy scores' scale, None where it is the main scale (today's path, bit for bit, on every backend)."""
    if proxy_scale is None:
        return None
    if not isinstance(proxy_scale, (int, float)) or isinstance(proxy_scale, bool):
        raise TypeError(f"{fn}: proxy_scale must be a Python float or None (the main scale), got "
                        f"{type(proxy_scale).__name__}")
    if not (math.isfinite(proxy_scale) and proxy_scale > 0):
        raise ValueError(f"{fn}: proxy_scale must be finite and positive (or None: the main scale), got "
                         f"{proxy_scale!r}")
    return None if float(proxy_scale) == scale else float(proxy_scale)


def check_local_blocks(fn: str, local_blocks, K: int) -> int:
    """1 <= local_blocks <= K: the forced recent blocks are part of the K selected ones."""
    if not _is_int(local_blocks):
        raise TypeError(f"{fn}: local_blocks must be an int, got {type(local_blocks).__name__}")
    if not 1 <= local_blocks <= K:
        raise ValueError(f"{fn}: local_blocks = {local_blocks} is not supported with K = top_k // block_size = {K} "
                         f"selected blocks; supported: 1 <= local_blocks <= K")
    return int(local_blocks)


def check_sinks(fn: str, sinks, H: int, device: torch.device) -> torch.Tensor | None:
    """None, or a float32 (H,) tensor on the inputs' device (usually an nn.Parameter: its gradient flows)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{fn}: sinks must be a float32 tensor of shape (H,) = ({H},) or None, got "
                        f"{type(sinks).__name__}")
    if tuple(sinks.shape) != (H,):
        raise ValueError(f"{fn}: sinks has shape {tuple(sinks.shape)}; supported: (H,) = ({H},), one sink logit per "
                         f"main query head")
    if sinks.dtype != torch.float32:
        raise ValueError(f"{fn}: sinks has dtype {sinks.dtype}; supported: torch.float32")
    if sinks.device != device:
        raise ValueError(f"{fn}: sinks is on {sinks.device} but the inputs are on {device}")
    return sinks


def check_kl_metric(fn: str, kl_metric, device: torch.device) -> None:
    if kl_metric is None:
        return
    if not isinstance(kl_metric, torch.Tensor):
        raise TypeError(f"{fn}: kl_metric must be a 0-dim float32 tensor or None, got {type(kl_metric).__name__}")
    if kl_metric.dim() != 0 or kl_metric.dtype != torch.float32:
        raise ValueError(f"{fn}: kl_metric must be a 0-dim float32 tensor, got shape {tuple(kl_metric.shape)} "
                         f"dtype {kl_metric.dtype}")
    if kl_metric.device != device:
        raise ValueError(f"{fn}: kl_metric is on {kl_metric.device} but the inputs are on {device}")
    if kl_metric.requires_grad:
        raise ValueError(f"{fn}: kl_metric receives the KL value in place and must not require grad")


KL_VALUES = ("exact", "deferred", "none")
SELECT_PRECISIONS = ("bf16", "fp8")


def check_select_precision(fn: str, select_precision) -> str:
    if not isinstance(select_precision, str) or select_precision not in SELECT_PRECISIONS:
        raise ValueError(f"{fn}: select_precision={select_precision!r} is not supported; expected one of "
                         f"{', '.join(SELECT_PRECISIONS)}")
    return select_precision


def check_kl_value(fn: str, kl_value, kl_metric) -> str:
    if not isinstance(kl_value, str) or kl_value not in KL_VALUES:
        raise ValueError(f"{fn}: kl_value={kl_value!r} is not supported; expected one of {', '.join(KL_VALUES)}")
    if kl_value == "none" and kl_metric is not None:
        raise ValueError(f"{fn}: kl_value='none' computes no KL value, so kl_metric must be None (got a tensor); pass "
                         f"kl_value='deferred' to receive the value in kl_metric during the backward")
    return kl_value


def check_cu_seqlens(fn: str, cu_seqlens, device: torch.device, name: str = "cu_seqlens") -> None:
    """Type, dtype, shape and device of cu_seqlens (or cu_seqlens_k: `name`); its values are checked by
    check_cu_seqlens_values."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor of int32 offsets, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{fn}: {name} must have dtype torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{fn}: {name} must be 1-D (num_seqs + 1,) with at least 2 entries, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"{fn}: {name} is on {cu_seqlens.device} but the inputs are on {device}")


def check_cu_seqlens_values(fn: str, cu_seqlens: torch.Tensor, total: int, row_len: int | None = None,
                            name: str = "cu_seqlens") -> int:
    """Offsets start at 0, end at total, never decrease and (row_len given) contain every multiple of row_len.

    Reads cu_seqlens on the host: one synchronisation, on the varlen path only, which the packed ops' own reads of
    the same tensor then reuse (flash_msa_rt.ops.offsets). Returns the longest sequence.
    """
    view = host_view(cu_seqlens)
    offs = view.tensor
    if int(offs[0]) != 0 or int(offs[-1]) != total:
        raise ValueError(f"{fn}: {name} must start at 0 and end at the {total} tokens, got "
                         f"{_short(view.values)}")
    if bool((view.lengths < 0).any()):
        raise ValueError(f"{fn}: {name} must be non-decreasing, got {_short(view.values)}")
    if row_len is not None:
        rows = torch.arange(0, total + 1, row_len)
        absent = ~torch.isin(rows, offs)
        if bool(absent.any()):
            raise ValueError(f"{fn}: cu_seqlens over the flattened batch * seqlen tokens must contain every batch-"
                             f"row boundary (multiples of seqlen={row_len}); missing {_short(rows[absent].tolist())}")
    return view.longest()


def _short(values: list) -> str:
    return str(values) if len(values) <= 12 else f"[{', '.join(map(str, values[:10]))}, ... {values[-1]}] " \
                                                   f"({len(values)} entries)"


def check_max_seqlen(fn: str, max_seqlen, longest: int, name: str = "max_seqlen",
                     offsets: str = "cu_seqlens") -> None:
    if not _is_int(max_seqlen) or max_seqlen < 0:
        raise ValueError(f"{fn}: {name} must be a non-negative int, got {max_seqlen!r}")
    if max_seqlen < longest:
        raise ValueError(f"{fn}: {name}={max_seqlen} is smaller than the longest sequence in {offsets} "
                         f"({longest})")


def check_key_offsets(fn: str, cu_seqlens: torch.Tensor, cu_seqlens_k, seqused_k, total_k: int,
                      device: torch.device) -> int:
    """Separate key lengths: cu_seqlens_k (and seqused_k) against the query offsets cu_seqlens, already checked.

    cu_seqlens_k: int32 (num_seqs + 1,) like cu_seqlens, from 0 to total_k, non-decreasing. seqused_k: None, or
    int32 (num_seqs,): sequence s then reads the keys [cu_seqlens_k[s], cu_seqlens_k[s] + seqused_k[s]), which
    may overlap other sequences' keys and must end by total_k. Every sequence needs L_q <= L_k (its queries are
    the last L_q of its L_k positions). Reads the offsets on the host (the varlen path only, which runs on the
    reference). Returns the longest key sequence.
    """
    check_cu_seqlens(fn, cu_seqlens_k, device, name="cu_seqlens_k")
    if cu_seqlens_k.shape[0] != cu_seqlens.shape[0]:
        raise ValueError(f"{fn}: cu_seqlens_k has {cu_seqlens_k.shape[0]} entries but cu_seqlens has "
                         f"{cu_seqlens.shape[0]}; both are (num_seqs + 1,), one entry per sequence boundary")
    check_cu_seqlens_values(fn, cu_seqlens_k, total_k, name="cu_seqlens_k")
    k_offs = cu_seqlens_k.tolist()
    starts, ends = k_offs[:-1], k_offs[1:]
    if seqused_k is not None:
        check_seqused_k(fn, seqused_k, len(starts), device)
        used = seqused_k.tolist()
        for s, (a, n) in enumerate(zip(starts, used)):
            if n < 0 or a + n > total_k:
                raise ValueError(f"{fn}: seqused_k[{s}]={n} with cu_seqlens_k[{s}]={a} reads keys [{a}, {a + n}); "
                                 f"supported: 0 <= seqused_k[s] and cu_seqlens_k[s] + seqused_k[s] <= the {total_k} "
                                 f"key tokens")
        ends = [a + n for a, n in zip(starts, used)]
    q_offs = host_offsets(cu_seqlens)
    for s, (qa, qb, ka, kb) in enumerate(zip(q_offs[:-1], q_offs[1:], starts, ends)):
        if qb - qa > kb - ka:
            raise ValueError(f"{fn}: sequence {s} has L_q={qb - qa} queries (cu_seqlens) but L_k={kb - ka} keys "
                             f"(cu_seqlens_k{' / seqused_k' if seqused_k is not None else ''}); L_q <= L_k is "
                             f"required: the queries are the last L_q of the sequence's L_k positions")
    return max(b - a for a, b in zip(starts, ends))


def check_seqused_k(fn: str, seqused_k, num_seqs: int, device: torch.device) -> None:
    """seqused_k's type, dtype, shape (num_seqs,) and device (no value read)."""
    if not isinstance(seqused_k, torch.Tensor):
        raise TypeError(f"{fn}: seqused_k must be a torch.Tensor of int32 key counts or None, got "
                        f"{type(seqused_k).__name__}")
    if seqused_k.dtype != torch.int32:
        raise TypeError(f"{fn}: seqused_k must have dtype torch.int32, got {seqused_k.dtype}")
    if tuple(seqused_k.shape) != (num_seqs,):
        raise ValueError(f"{fn}: seqused_k must have shape (num_seqs,) = ({num_seqs},), got "
                         f"{tuple(seqused_k.shape)}")
    if seqused_k.device != device:
        raise ValueError(f"{fn}: seqused_k is on {seqused_k.device} but the inputs are on {device}")


def check_document_list(fn: str, document_list, B: int, S: int, device: torch.device) -> None:
    if not isinstance(document_list, torch.Tensor):
        raise TypeError(f"{fn}: document_list must be a (batch, seqlen) integer tensor of document ids, got "
                        f"{type(document_list).__name__}")
    if document_list.dtype not in INDEX_DTYPES:
        raise TypeError(f"{fn}: document_list must have an integer dtype, got {document_list.dtype}")
    if tuple(document_list.shape) != (B, S):
        raise ValueError(f"{fn}: document_list must have shape (batch, seqlen) = {(B, S)}, got "
                         f"{tuple(document_list.shape)}")
    if document_list.device != device:
        raise ValueError(f"{fn}: document_list is on {document_list.device} but the inputs are on {device}")


def check_block_indices(fn: str, block_indices, B: int, S: int, H: int, device: torch.device) -> int:
    """block_indices (B, Hi, S, K) int32 with H % Hi == 0; returns K. Index values are the backend's to check."""
    if not isinstance(block_indices, torch.Tensor):
        raise TypeError(f"{fn}: block_indices must be a torch.Tensor, got {type(block_indices).__name__}")
    if block_indices.dtype != torch.int32:
        raise TypeError(f"{fn}: block_indices must have dtype torch.int32 (-1 for empty slots), got "
                        f"{block_indices.dtype}")
    if block_indices.dim() != 4:
        raise ValueError(f"{fn}: block_indices must be (batch, index_heads, seqlen, K), got shape "
                         f"{tuple(block_indices.shape)}")
    b, hi, s, K = block_indices.shape
    if b != B or s != S:
        raise ValueError(f"{fn}: block_indices has shape {tuple(block_indices.shape)}; it must be (batch, "
                         f"index_heads, seqlen, K) with batch={B} and seqlen={S}")
    if hi < 1 or H % hi:
        raise ValueError(f"{fn}: block_indices has {hi} index heads; q's {H} heads must be a multiple of them")
    if K < 1:
        raise ValueError(f"{fn}: block_indices has K={K} slots; at least 1 is needed")
    if block_indices.device != device:
        raise ValueError(f"{fn}: block_indices is on {block_indices.device} but q is on {device}")
    return K
