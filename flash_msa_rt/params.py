"""Validate launch arguments against a variant's param ABI and pack them into kernel param buffers.

Two levels, so that a training loop pays for validation once:
  - a Plan per tensor *layout* (dtypes, shapes, strides, alignment class, scalar values): every check of a
    compile-time assumption, the size bindings, the grid, and a byte template of all params;
  - a Packed per full signature (the plan plus data pointers): the template with pointers patched in and TMA
    descriptors encoded. Launching a Packed is one driver call.
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from flash_msa_rt.manifest import (DTYPES, SCALAR_TYPES, ScalarParam, TensorParam, TmaCoordParam, TmaParam,
                                   VariantEntry, ZerosParam)

INT32_MAX = 2**31 - 1
DESCRIPTOR_CACHE_SIZE = 512  # encoded TMA descriptors kept per plan
# Largest global dimension and stride cuTensorMapEncodeTiled accepts.
TMA_MAX_DIM, TMA_MAX_STRIDE = 2**32, 2**40

_TORCH_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64", "int32": "i32",
                      "int64": "i64", "uint8": "u8", "int16": "i16",
                      "float8_e4m3fn": "e4m3"}


def dtype_name(torch_dtype) -> str:
    return _TORCH_DTYPE_NAMES.get(str(torch_dtype).replace("torch.", ""), str(torch_dtype))


class TensorDescription:
    """How one launch argument is described: dtype and shape entries (symbols bind sizes across arguments)."""

    def __init__(self, name: str, dtype: str, shape: tuple, stride: tuple | None, align: int,
                 divisibility: dict[str, int]):
        self.name, self.dtype, self.shape, self.stride = name, dtype, shape, stride
        self.align, self.divisibility = align, divisibility

    @property
    def dynamic_modes(self) -> list[int]:
        return [m for m, s in enumerate(self.shape) if isinstance(s, str)]


def describe(entry: VariantEntry) -> dict[str, TensorDescription]:
    """name -> description of every tensor argument the variant takes."""
    out: dict[str, TensorDescription] = {}
    for p in entry.params:
        if isinstance(p, TensorParam):
            out[p.name] = TensorDescription(p.name, p.dtype, p.shape, p.stride, p.align, p.divisibility)
    for p in entry.params:
        if isinstance(p, TmaParam) and p.tensor not in out:
            if not p.dtype or not p.shape:
                raise ValueError(f"{entry.name}: TMA param {p.name} names tensor {p.tensor!r}, which no "
                                 f"TensorParam describes, and gives no dtype/shape of its own")
            # TMA needs 16-byte aligned global addresses.
            out[p.tensor] = TensorDescription(p.tensor, p.dtype, p.shape, None, 16, {})
    return out


def check_tensor(desc: TensorDescription, t: Any, env: dict[str, int], bound_by: dict[str, str], op: str) -> None:
    """Check one tensor against every assumption its variant was compiled with; binds its size symbols."""
    where = f"{op}: argument {desc.name}"
    if not hasattr(t, "data_ptr") or not hasattr(t, "stride"):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{where} must be on a CUDA device, got device {t.device}")
    if dtype_name(t.dtype) != desc.dtype:
        raise TypeError(f"{where} has dtype {t.dtype}; this kernel takes {desc.dtype}")
    if t.dim() != len(desc.shape):
        raise ValueError(f"{where} has {t.dim()} dims (shape {tuple(t.shape)}); expected {len(desc.shape)} "
                         f"({', '.join(map(str, desc.shape))})")
    for m, (want, got) in enumerate(zip(desc.shape, t.shape)):
        if isinstance(want, int):
            if got != want:
                raise ValueError(f"{where}: shape[{m}] is {got}; this variant was compiled for {want}")
            continue
        if not 0 < got <= INT32_MAX:
            raise ValueError(f"{where}: shape[{m}] = {want} = {got} is outside 1..{INT32_MAX} (int32 in the kernel)")
        if want in env and env[want] != got:
            raise ValueError(f"{where}: shape[{m}] = {want} = {got}, but {bound_by[want]} gives {want} = {env[want]}")
        env[want], bound_by[want] = got, f"{desc.name}.shape[{m}]"
        div = desc.divisibility.get(want, 1)
        if got % div:
            raise ValueError(f"{where}: shape[{m}] = {want} = {got} must be a multiple of {div} for this variant")
    if desc.stride is not None:
        for m, (want, got) in enumerate(zip(desc.stride, t.stride())):
            if isinstance(want, int):
                if got != want and t.shape[m] != 1:
                    raise ValueError(f"{where}: stride[{m}] is {got}; this variant needs {want} "
                                     f"(call .contiguous() or use the layout the op documents)")
            elif want == "i32" and got > INT32_MAX:
                raise ValueError(f"{where}: stride[{m}] = {got} exceeds int32 (this variant uses 32-bit strides)")
    if t.data_ptr() % desc.align:
        raise ValueError(f"{where}: data pointer {t.data_ptr():#x} is not {desc.align}-byte aligned, which this "
                         f"variant assumes (a view with a storage offset breaks it; clone the tensor)")


def check_tma_source(p: TmaParam, t: Any, op: str) -> None:
    esize = DTYPES[dtype_name(t.dtype)][0]
    where = f"{op}: argument {p.tensor}"
    if t.stride(p.dims[0]) != 1:
        raise ValueError(f"{where}: stride[{p.dims[0]}] is {t.stride(p.dims[0])}; the TMA load needs it to be 1")
    for m in p.dims[1:]:
        b = t.stride(m) * esize
        if b % 16 or b >= TMA_MAX_STRIDE:
            raise ValueError(f"{where}: stride[{m}] = {t.stride(m)} elements ({b} bytes) must be a multiple of "
                             f"16 bytes below 2**40 for the TMA load")
    for m in p.dims:
        if t.shape[m] > TMA_MAX_DIM:
            raise ValueError(f"{where}: shape[{m}] = {t.shape[m]} exceeds the TMA limit {TMA_MAX_DIM}")


def pack_scalar(p: ScalarParam, value: Any, op: str) -> bytes:
    fmt = "<" + SCALAR_TYPES[p.ctype][1]
    if p.ctype in ("i32", "i64"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{op}: scalar {p.name} must be an int, got {value!r}")
        lim = INT32_MAX if p.ctype == "i32" else 2**63 - 1
        if not -lim - 1 <= value <= lim:
            raise ValueError(f"{op}: scalar {p.name} = {value} does not fit {p.ctype}")
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{op}: scalar {p.name} must be a float, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{op}: scalar {p.name} = {value} must be finite")
    return struct.pack(fmt, value)


@dataclass
class Slot:
    param: Any
    offset: int  # into the param buffer


class Plan:
    """Validated layout of one launch signature: grid, env, the byte template and where pointers go."""

    def __init__(self, entry: VariantEntry, args: dict[str, Any], grid_rules: list[Callable], op: str):
        self.entry = entry
        descs = describe(entry)
        env: dict[str, int] = {}
        bound_by: dict[str, str] = {}
        for name, desc in descs.items():
            if name not in args:
                raise TypeError(f"{op}: missing tensor argument {name!r}")
            check_tensor(desc, args[name], env, bound_by, op)
        for p in entry.params:
            if isinstance(p, ScalarParam):
                if p.name not in args:
                    raise TypeError(f"{op}: missing scalar argument {p.name!r}")
                if p.ctype != "f32":
                    env.setdefault(p.name, args[p.name])
            elif isinstance(p, TmaParam):
                check_tma_source(p, args[p.tensor], op)
        self.env = env
        self.grid = tuple(rule(env) for rule in grid_rules)
        if any(g < 1 or g > (2**31 - 1 if i == 0 else 65535) for i, g in enumerate(self.grid)):
            raise ValueError(f"{op}: grid {self.grid} from rule {entry.grid} with {env} is outside CUDA's limits")

        # Byte template: every param at an offset aligned to 64 (the strictest: by-value TMA descriptors).
        self.slots: list[Slot] = []
        offset = 0
        for p in entry.params:
            self.slots.append(Slot(p, offset))
            offset += -(-p.size // 64) * 64
        self.nbytes = max(offset, 64)
        self.template = bytearray(self.nbytes)
        for s in self.slots:
            p = s.param
            if isinstance(p, TensorParam):
                self.template[s.offset:s.offset + p.size] = _tensor_blob(p, args[p.name], ptr=0)
            elif isinstance(p, ScalarParam):
                self.template[s.offset:s.offset + p.size] = pack_scalar(p, args[p.name], op)
            elif isinstance(p, TmaCoordParam):
                desc = descs[p.tensor]
                t = args[p.tensor]
                values = [t.shape[m] for m in desc.dynamic_modes]
                if len(values) != p.dynamic_modes:
                    raise ValueError(f"{entry.name}: {p.name} packs {p.dynamic_modes} extents, but {p.tensor} has "
                                     f"{len(values)} dynamic modes")
                self.template[s.offset:s.offset + p.size] = struct.pack(f"<{len(values)}i", *values)
            elif isinstance(p, ZerosParam):
                pass  # already zero
        self.tensor_slots = [s for s in self.slots if isinstance(s.param, TensorParam)]
        self.tma_slots = [s for s in self.slots if isinstance(s.param, TmaParam)]
        self.descriptors: OrderedDict[tuple[int, int], bytes] = OrderedDict()  # (slot offset, pointer) -> bytes

    def remember_descriptor(self, key: tuple[int, int], data: bytes) -> None:
        self.descriptors[key] = data
        if len(self.descriptors) > DESCRIPTOR_CACHE_SIZE:
            self.descriptors.popitem(last=False)


def _tensor_blob(p: TensorParam, t, ptr: int) -> bytes:
    blob = bytearray(p.size)
    shape_i = [t.shape[m] for m, s in enumerate(p.shape) if isinstance(s, str)]
    stride_i = [(t.stride(m), s) for m, s in enumerate(p.stride) if isinstance(s, str)]
    values = [ptr] + shape_i + [v for v, _ in stride_i]
    fmts = ["Q"] + ["i"] * len(shape_i) + ["q" if w == "i64" else "i" for _, w in stride_i]
    for (name, size, off), v, f in zip(p.layout(), values, fmts):
        struct.pack_into("<" + f, blob, off, v)
    return bytes(blob)


class Packed:
    """Param buffers for one full signature, kept alive for as long as the cache holds them."""

    def __init__(self, plan: Plan, args: dict[str, Any], encode_tma: Callable[..., None]):
        self.plan = plan
        raw = (ctypes.c_ubyte * (plan.nbytes + 64))()
        base = (ctypes.addressof(raw) + 63) // 64 * 64
        ctypes.memmove(base, bytes(plan.template), plan.nbytes)
        for s in plan.tensor_slots:  # the pointer is the blob's first field
            ctypes.c_uint64.from_address(base + s.offset).value = args[s.param.name].data_ptr()
        for s in plan.tma_slots:
            p, t = s.param, args[s.param.tensor]
            # A descriptor depends on the plan's layout and this tensor's pointer only: when just another
            # argument moved (a fresh output, say), the encoded bytes are reused rather than re-encoded.
            known = plan.descriptors.get((s.offset, t.data_ptr()))
            if known is not None:
                ctypes.memmove(base + s.offset, known, 128)
                continue
            esize, code = DTYPES[dtype_name(t.dtype)]
            span = (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * esize
            encode_tma(base + s.offset, code, t.data_ptr(), [t.shape[m] for m in p.dims],
                       [t.stride(m) * esize for m in p.dims[1:]], list(p.box), p.swizzle, p.l2_promotion,
                       p.oob_fill, span)
            plan.remember_descriptor((s.offset, t.data_ptr()), ctypes.string_at(base + s.offset, 128))
        self._raw = raw
        self._pointers = (ctypes.c_void_p * len(plan.slots))(*[base + s.offset for s in plan.slots])
        self.address = ctypes.addressof(self._pointers)
        self.config = None  # the driver's CUlaunchConfig, made by the loader


def launch_signature(names: tuple[str, ...], args: dict[str, Any]) -> tuple[tuple, tuple]:
    """(layout, pointers) of one launch, reading each tensor once.

    layout is everything a Plan depends on (per tensor dtype, shape, stride, device, pointer alignment class;
    per scalar its type and value); pointers are the tensors' data pointers, the rest of a Packed's key.
    Raises KeyError for a missing argument.
    """
    layout, pointers = [], []
    for n in names:
        v = args[n]
        if hasattr(v, "data_ptr"):
            ptr = v.data_ptr()
            layout.append((v.dtype, v.shape, v.stride(), v.device, ptr & 127))
            pointers.append(ptr)
        else:
            layout.append((type(v), v))
    return tuple(layout), tuple(pointers)
