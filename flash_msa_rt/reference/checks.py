"""Argument checks of the reference ops. Errors name the function, the argument, its value and what is supported.

Unlike the kernels' API, a reference may read tensor values (block index range, cu_seqlens): it is a test tool.
"""

from __future__ import annotations

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def tensor4(fn: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{fn}: {name} must be 4-D (B, S, heads, D), got shape {tuple(t.shape)}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{fn}: {name} has dtype {t.dtype}; supported: {', '.join(map(str, _FLOATS))}")
    return t


def main_dims(fn: str, q, k, v, *, keys_longer: bool = False) -> tuple[int, int, int, int, int]:
    """(B, S, H, Hk, D) of q (B, S, H, D) and k, v (B, S, Hk, D), H a multiple of Hk.

    keys_longer: k and v may hold S_k >= S positions (the queries are the last S of them).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor4(fn, name, t)
    B, S, H, D = q.shape
    Hk = k.shape[2]
    Sk = k.shape[1] if keys_longer and k.shape[1] >= S else S
    if tuple(k.shape) != (B, Sk, Hk, D) or tuple(v.shape) != tuple(k.shape):
        what = "S_k >= S" if keys_longer else "S"
        raise ValueError(f"{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B, {what}, Hk, D) with "
                         f"B = {B}, S = {S}, D = {D} to match q {tuple(q.shape)}")
    if Hk < 1 or H % Hk:
        raise ValueError(f"{fn}: H = {H} query heads must be a positive multiple of Hk = {Hk} kv heads")
    if S < 1:
        raise ValueError(f"{fn}: S = {S} must be positive (varlen references accept empty sequences)")
    same_device(fn, q=q, k=k, v=v)
    return B, S, H, Hk, D


def proxy_dims(fn: str, q_proxy, k_proxy, B: int, S: int, H: int | None,
               S_k: int | None = None) -> tuple[int, int, int]:
    """(Hp, Hpk, Dp) of q_proxy (B, S, Hp, Dp) and k_proxy (B, S_k, Hpk, Dp) (S_k = S unless given); Hp a multiple
    of Hpk, H of Hp."""
    tensor4(fn, "q_proxy", q_proxy)
    tensor4(fn, "k_proxy", k_proxy)
    Hp, Dp = q_proxy.shape[2], q_proxy.shape[3]
    Hpk = k_proxy.shape[2]
    S_k = S if S_k is None else S_k
    if tuple(q_proxy.shape[:2]) != (B, S) or tuple(k_proxy.shape) != (B, S_k, Hpk, Dp):
        raise ValueError(f"{fn}: q_proxy {tuple(q_proxy.shape)} and k_proxy {tuple(k_proxy.shape)} must be "
                         f"(B, S, Hp, Dp) and (B, S_k, Hpk, Dp) with B = {B}, S = {S}, S_k = {S_k}")
    if Hpk < 1 or Hp % Hpk:
        raise ValueError(f"{fn}: Hp = {Hp} proxy heads must be a positive multiple of Hpk = {Hpk} proxy key heads")
    if H is not None and (Hp < 1 or H % Hp):
        raise ValueError(f"{fn}: H = {H} main heads must be a multiple of Hp = {Hp} proxy heads")
    same_device(fn, q_proxy=q_proxy, k_proxy=k_proxy)
    return Hp, Hpk, Dp


def same_device(fn: str, **tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{fn}: tensors on different devices: {devices}")


def block_size(fn: str, bs) -> int:
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise ValueError(f"{fn}: block_size must be a positive int, got {bs!r}")
    return bs


def scale(fn: str, s) -> float:
    try:
        s = float(s)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: scale must be a real number, got {s!r}") from None
    if not s > 0:
        raise ValueError(f"{fn}: scale must be > 0, got {s!r}")
    return s


def proxy_scale(fn: str, s, scale: float) -> float:
    """The proxy scores' scale: scale when None, else a positive real number."""
    if s is None:
        return scale
    try:
        s = float(s)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: proxy_scale must be a real number or None, got {s!r}") from None
    if not s > 0:
        raise ValueError(f"{fn}: proxy_scale must be > 0, got {s!r}")
    return s


def local_blocks(fn: str, n, K: int) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= K:
        raise ValueError(f"{fn}: local_blocks must be an int with 1 <= local_blocks <= K = {K}, got {n!r}")
    return n


def sinks(fn: str, t, H: int, device) -> torch.Tensor | None:
    """None, or (H,) floating sink logits on device (float32 or float64 on the reference)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != H or not t.is_floating_point():
        shown = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: sinks must be a float tensor of shape (H,) = ({H},), got {shown}")
    same_device(fn, sinks=t, q=torch.empty(0, device=device))
    return t


def top_k_blocks(fn: str, k) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{fn}: top_k_blocks must be an int >= 1 (selected blocks per query), got {k!r}")
    return k


def block_indices(fn: str, idx, B: int, S: int, H: int, bs: int, *, heads: int | None = None,
                  S_k: int | None = None) -> int:
    """Check (B, Hi, S, K) integer indices in [-1, ceil(S_k / bs)) (S_k = S unless given, the key positions);
    H % Hi == 0 (Hi == heads when given). -> Hi."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{fn}: block_indices must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in _INTS:
        raise TypeError(f"{fn}: block_indices has dtype {idx.dtype}; supported: integer dtypes (int32 usual)")
    if idx.dim() != 4 or idx.shape[0] != B or idx.shape[2] != S:
        raise ValueError(f"{fn}: block_indices must be (B, Hi, S, K) = ({B}, Hi, {S}, K), got {tuple(idx.shape)}")
    Hi = idx.shape[1]
    if heads is not None and Hi != heads:
        raise ValueError(f"{fn}: block_indices has {Hi} heads, expected one per proxy head ({heads})")
    if Hi < 1 or H % Hi:
        raise ValueError(f"{fn}: block_indices has Hi = {Hi} heads; H = {H} must be a positive multiple of it")
    S_k = S if S_k is None else S_k
    nb = -(-S_k // bs)
    keys = "S" if S_k == S else "S_k"
    if idx.numel():
        bad = (idx < -1) | (idx >= nb)
        if bool(bad.any()):
            where = tuple(int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{fn}: block_indices{list(where)} = {int(idx[where])} is outside [-1, {nb}) "
                             f"(-1 = empty slot; {keys} = {S_k}, block_size = {bs} give {nb} blocks)")
    return Hi


def like(fn: str, name: str, t, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def kl_weights(fn: str, kl_grad, shape: tuple[int, int, int], dtype: torch.dtype, device) -> torch.Tensor | None:
    """kl_grad broadcast to (B, Hp, S) in the compute dtype, or None (no proxy gradient)."""
    if kl_grad is None:
        return None
    if not isinstance(kl_grad, torch.Tensor):
        kl_grad = torch.as_tensor(kl_grad)
    try:
        return torch.broadcast_to(kl_grad.to(device=device, dtype=dtype), shape)
    except RuntimeError:
        raise ValueError(f"{fn}: kl_grad of shape {tuple(kl_grad.shape)} does not broadcast to (B, Hp, S) = "
                         f"{shape}") from None
