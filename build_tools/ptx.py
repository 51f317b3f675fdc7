"""Facts read from PTX text: the entry symbol and its .param list (size and alignment of each param)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.S)
# .param .align 8 .b8 name[24]   |   .param .u32 name   |   .param .f32 name
_PARAM = re.compile(r"\.param\s+(?:\.attribute\(\.\w+\)\s+)?(?:\.align\s+(\d+)\s+)?\.(\w+)\s+[\w$]+(?:\[(\d+)\])?")
_SCALAR_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2,
                 "b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


class PtxError(ValueError):
    pass


@dataclass(frozen=True)
class PtxEntry:
    name: str
    params: list[tuple[int, int]]  # (size, alignment) in declaration order


def entries(ptx: str) -> list[PtxEntry]:
    out = []
    for m in _ENTRY.finditer(ptx):
        params = []
        for decl in filter(None, (d.strip() for d in m.group(2).split(","))):
            p = _PARAM.search(decl)
            if not p:
                raise PtxError(f"entry {m.group(1)}: cannot parse param declaration {decl!r}")
            align, ty, count = p.group(1), p.group(2), p.group(3)
            elem = _SCALAR_BYTES.get(ty)
            if elem is None:
                raise PtxError(f"entry {m.group(1)}: unknown param type .{ty} in {decl!r}")
            size = elem * int(count or 1)
            params.append((size, int(align) if align else elem))
        out.append(PtxEntry(m.group(1), params))
    return out


def single_entry(ptx: str) -> PtxEntry:
    found = entries(ptx)
    if len(found) != 1:
        raise PtxError(f"expected exactly one .entry in the PTX, found {len(found)}: {[e.name for e in found]}")
    return found[0]
