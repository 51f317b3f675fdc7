"""The artifact manifest: the one definition of what a compiled variant is.

build_tools writes it (importing the dataclasses below), the runtime reads it. Nothing here imports cutlass
or torch, so both sides and the CPU tests can use it.

A manifest lives at artifacts/<arch>/manifest.json and describes every cubin beside it:

    {"schema": 1, "arch": "sm90a", "fingerprint": {...}, "hardware_verified": true,
     "variants": {name: VariantEntry, ...}}

hardware_verified records, at build time, whether cubins of this arch have run the self-test on real hardware
(build_tools.build.HARDWARE_VERIFIED_ARCHS). It is optional and additive, so the schema stays 1: a runtime that
predates it ignores it, and a manifest that predates it reads as None (flash_msa_rt.guard decides what that means).

The param ABI is the ordered list of kernel params exactly as CuTeDSL emits them (see
docs/aot-facts.md, "The kernel parameter ABI"); the runtime packs one buffer per param and passes
one pointer per param to cuLaunchKernelEx.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

SCHEMA_VERSION = 1

# Element types a tensor param may carry: name -> (bytes per element, CUtensorMapDataType value).
# The data-type codes are those of cuda.h's CUtensorMapDataType enum.
DTYPES: dict[str, tuple[int, int]] = {
    "u8": (1, 0),
    "u16": (2, 1),
    "u32": (4, 2),
    "i32": (4, 3),
    "u64": (8, 4),
    "i64": (8, 5),
    "f16": (2, 6),
    "f32": (4, 7),
    "f64": (8, 8),
    "bf16": (2, 9),
    "e4m3": (1, 0),  # float8 e4m3: TMA moves it as bytes (UINT8)
}

# Scalar params: name -> (bytes, struct format character).
SCALAR_TYPES: dict[str, tuple[int, str]] = {"i32": (4, "i"), "i64": (8, "q"), "f32": (4, "f")}

# A shape entry is a symbol (a dynamic int32 in the param blob, bound by name across all tensors of one launch)
# or an int (static: baked into the cubin, checked at run time, absent from the blob).
ShapeEntry = Union[str, int]
# A stride entry is an int (static: baked in, checked, absent from the blob), "i64" or "i32" (dynamic, in the
# blob at that width).
StrideEntry = Union[str, int]

MODE_DYNAMIC_STRIDE = ("i64", "i32")


class ManifestError(ValueError):
    """A manifest or param declaration that breaks the schema."""


@dataclass(frozen=True)
class TensorParam:
    """A global-memory cute.Tensor: pointer, then dynamic shape values in mode order, then dynamic strides.

    divisibility maps a shape symbol to the divisor the cubin assumes for it (cute.sym_int(divisibility=...)).
    align is the pointer alignment in bytes the cubin assumes (assumed_align).
    """

    name: str
    dtype: str
    shape: tuple[ShapeEntry, ...]
    stride: tuple[StrideEntry, ...]
    align: int = 16
    divisibility: dict[str, int] = field(default_factory=dict)
    kind: str = "tensor"

    def __post_init__(self):
        _check(self.dtype in DTYPES, f"tensor {self.name}: dtype {self.dtype!r} not in {sorted(DTYPES)}")
        _check(len(self.shape) == len(self.stride), f"tensor {self.name}: shape and stride ranks differ")
        for s in self.stride:
            _check(isinstance(s, int) or s in MODE_DYNAMIC_STRIDE, f"tensor {self.name}: bad stride entry {s!r}")
        for s in self.shape:
            _check(isinstance(s, (int, str)), f"tensor {self.name}: bad shape entry {s!r}")
        for sym in self.divisibility:
            _check(sym in self.shape, f"tensor {self.name}: divisibility names {sym!r}, not one of its symbols")

    def layout(self) -> list[tuple[str, int, int]]:
        """(field, size, offset) of every field of the blob, natural C alignment, in order."""
        fields = [("ptr", 8)]
        fields += [(f"shape[{m}]", 4) for m, s in enumerate(self.shape) if isinstance(s, str)]
        fields += [(f"stride[{m}]", 8 if s == "i64" else 4) for m, s in enumerate(self.stride) if isinstance(s, str)]
        return _c_struct(fields)

    @property
    def size(self) -> int:
        return _struct_size(self.layout())

    @property
    def alignment(self) -> int:
        return 8


@dataclass(frozen=True)
class ScalarParam:
    """An Int32 / Int64 / Float32 kernel argument, passed at its exact width."""

    name: str
    ctype: str
    kind: str = "scalar"

    def __post_init__(self):
        _check(self.ctype in SCALAR_TYPES, f"scalar {self.name}: ctype {self.ctype!r} not in {sorted(SCALAR_TYPES)}")

    @property
    def size(self) -> int:
        return SCALAR_TYPES[self.ctype][0]

    @property
    def alignment(self) -> int:
        return self.size


@dataclass(frozen=True)
class TmaParam:
    """A CUtensorMap passed by value (128 bytes, 64-aligned), encoded at run time with cuTensorMapEncodeTiled.

    tensor names the launch argument it reads. dims lists that tensor's modes in the descriptor's order,
    innermost (unit stride) first; box gives the box extent of each of those dims. swizzle is 0, 32, 64 or
    128 (bytes); l2_promotion 0, 64, 128 or 256 (bytes); oob_fill "none" (zeros) or "nan".
    """

    name: str
    tensor: str
    dims: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int
    l2_promotion: int = 128
    oob_fill: str = "none"
    # The source tensor's element type and shape (symbols / static ints, as in TensorParam). Leave them empty
    # when a TensorParam of the same name describes the tensor too.
    dtype: str = ""
    shape: tuple[ShapeEntry, ...] = ()
    kind: str = "tma"

    def __post_init__(self):
        _check(len(self.dims) == len(self.box), f"tma {self.name}: dims and box ranks differ")
        _check(1 <= len(self.dims) <= 5, f"tma {self.name}: rank {len(self.dims)} outside 1..5")
        _check(all(1 <= b <= 256 for b in self.box), f"tma {self.name}: box {self.box} outside 1..256")
        _check(self.swizzle in (0, 32, 64, 128), f"tma {self.name}: swizzle {self.swizzle}")
        _check(self.l2_promotion in (0, 64, 128, 256), f"tma {self.name}: l2_promotion {self.l2_promotion}")
        _check(self.oob_fill in ("none", "nan"), f"tma {self.name}: oob_fill {self.oob_fill!r}")

    size = 128
    alignment = 64


@dataclass(frozen=True)
class TmaCoordParam:
    """The TMA coordinate tensor beside a TMA atom: the source tensor's dynamic shape values, int32 each.

    Which modes are dynamic comes from the tensor's description (its TensorParam, or the TmaParam's shape);
    dynamic_modes states their count so the ABI size is known without it.
    """

    name: str
    tensor: str
    dynamic_modes: int
    kind: str = "tma_coord"

    @property
    def size(self) -> int:
        return 4 * self.dynamic_modes

    @property
    def alignment(self) -> int:
        return 4


@dataclass(frozen=True)
class ZerosParam:
    """Opaque runtime state the host passes as zeros (tiled-MMA state: 1 byte on Hopper, 32 on Blackwell)."""

    name: str
    nbytes: int
    align: int = 1
    kind: str = "zeros"

    @property
    def size(self) -> int:
        return self.nbytes

    @property
    def alignment(self) -> int:
        return self.align


Param = Union[TensorParam, ScalarParam, TmaParam, TmaCoordParam, ZerosParam]
PARAM_KINDS = {cls.kind: cls for cls in (TensorParam, ScalarParam, TmaParam, TmaCoordParam, ZerosParam)}


@dataclass(frozen=True)
class VariantEntry:
    """Everything the runtime needs to load and launch one compiled variant."""

    name: str
    op: str
    arch: str
    config: dict[str, Any]
    params: tuple[Param, ...]
    grid: tuple[str, str, str]  # expressions over shape symbols and scalar names (see flash_msa_rt.grid)
    block: tuple[int, int, int]
    cluster: tuple[int, int, int] = (1, 1, 1)
    smem_bytes: int = 0  # dynamic shared memory
    cubin: str = ""
    sha256: str = ""
    entry: str = ""
    registers: int = 0
    local_bytes: int = 0  # per-thread stack frame: spills or local arrays
    fingerprint: str = ""

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["params"] = [dataclasses.asdict(p) for p in self.params]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "VariantEntry":
        try:
            params = tuple(_param_from_json(p) for p in d["params"])
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = set(d) - fields
            _check(not unknown, f"variant {d.get('name')!r}: unknown fields {sorted(unknown)}")
            kw = dict(d, params=params)
            for key in ("grid", "block", "cluster"):
                kw[key] = tuple(kw[key])
            return cls(**kw)
        except (KeyError, TypeError) as e:
            raise ManifestError(f"variant {d.get('name')!r}: malformed entry ({e})") from e


def _param_from_json(p: dict[str, Any]) -> Param:
    kind = p.get("kind")
    _check(kind in PARAM_KINDS, f"param {p.get('name')!r}: kind {kind!r} not in {sorted(PARAM_KINDS)}")
    kw = dict(p)
    for key in ("shape", "stride", "dims", "box"):
        if key in kw:
            kw[key] = tuple(kw[key])
    return PARAM_KINDS[kind](**kw)


@dataclass(frozen=True)
class Manifest:
    arch: str
    fingerprint: dict[str, str]
    variants: dict[str, VariantEntry]
    schema: int = SCHEMA_VERSION
    hardware_verified: bool | None = None  # None: written before the field existed

    def to_json(self) -> dict[str, Any]:
        d = {
            "schema": self.schema,
            "arch": self.arch,
            "fingerprint": dict(self.fingerprint),
            "variants": {n: v.to_json() for n, v in sorted(self.variants.items())},
        }
        if self.hardware_verified is not None:
            d["hardware_verified"] = self.hardware_verified
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Manifest":
        _check(isinstance(d, dict), "manifest: top level is not an object")
        _check(d.get("schema") == SCHEMA_VERSION, f"manifest: schema {d.get('schema')!r}, expected {SCHEMA_VERSION}")
        variants = {n: VariantEntry.from_json(v) for n, v in d.get("variants", {}).items()}
        for n, v in variants.items():
            _check(v.name == n, f"manifest: variant keyed {n!r} is named {v.name!r}")
            _check(v.arch == d["arch"], f"manifest: variant {n!r} has arch {v.arch!r} in a {d['arch']!r} manifest")
        verified = d.get("hardware_verified")
        _check(verified is None or isinstance(verified, bool),
               f"manifest: hardware_verified {verified!r} is not true, false or absent")
        return cls(arch=d["arch"], fingerprint=dict(d["fingerprint"]), variants=variants, hardware_verified=verified)

    @classmethod
    def load(cls, path: Path) -> "Manifest":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: not valid JSON ({e})") from e


def fingerprint_string(fp: dict[str, str]) -> str:
    """The one-line form of a build fingerprint stored in each variant."""
    return ";".join(f"{k}={fp[k]}" for k in sorted(fp))


def param_layout(params: tuple[Param, ...]) -> list[tuple[int, int]]:
    """(size, alignment) of every param, the way the PTX .param list must declare them."""
    return [(p.size, p.alignment) for p in params]


def _c_struct(fields: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    out, offset = [], 0
    for name, size in fields:
        offset = (offset + size - 1) // size * size
        out.append((name, size, offset))
        offset += size
    return out


def _struct_size(layout: list[tuple[str, int, int]]) -> int:
    end = max(off + size for _, size, off in layout)
    align = max(size for _, size, _ in layout)
    return (end + align - 1) // align * align


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ManifestError(message)


# How each config field is spelled in a variant name. Every field of a kernel config must appear here, so the
# name is complete: two variants that differ in any codegen choice never share a name.
NAME_TAGS: dict[str, str] = {
    "dtype": "",
    "head_dim": "d",
    "proxy_head_dim": "dp",
    "block_size": "b",
    "max_k": "k",
    "tile_m": "m",
    "tile_n": "n",
    "group": "g",
    "threads": "t",
    "stages": "s",
    "mma": "mma",  # mmasync (mma.sync) or mmawgmma (Hopper warpgroup MMA)
    "schedule": "sched",  # schedlockstep or schedpingpong: how a kernel's warpgroups share a tile's phases
    "heads": "heads",  # headsstepped, headsresident or headstau: how the proxy backward gets a tile's tau
    "tau_out": "tauout",  # tauout1: the main backward also writes tau for the proxy backward
    "deterministic": "det",  # det1: partial rows stored for a fixed-order sum instead of fp32 atomics
    "heads_per_warp": "hw",  # the combine: how many of a row's G heads one warp merges
    "phase": "phase",  # plan_lists: phasecount (phase 1) or phasescatter (phase 2)
    "kl_value": "kl",  # KL kernels: kl1 forms each row's KL value, kl0 the proxy lse only (warmup_kl, sparse_kl)
    "scale_rows": "sr",  # bwd_delta, sparse_combine: sr1 also scales each row by its kept mass under a sink
}


def variant_name(op: str, config: dict[str, Any], arch: str) -> str:
    """Deterministic, complete variant name: op, then every config field in declaration order, then arch.

    e.g. variant_name("block_scores", {"dtype": "bf16", "head_dim": 128, "block_size": 128}, "sm90a")
    == "block_scores_bf16_d128_b128_sm90a".
    """
    parts = [op]
    for key, value in config.items():
        if key not in NAME_TAGS:
            raise ManifestError(f"config field {key!r} of op {op!r} has no name tag; add it to NAME_TAGS")
        parts.append(f"{NAME_TAGS[key]}{value}")
    parts.append(arch)
    return "_".join(str(p) for p in parts)


def source_hash(root: Path) -> str:
    """sha256 over the .py files under root (sorted relative paths and contents).

    Build and runtime hash kernel sources the same way: the build stamps each variant with the hash of its
    family's sources, and a runtime running from a source checkout compares it to catch stale artifacts.
    """
    import hashlib

    h = hashlib.sha256()
    root = Path(root)
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()
