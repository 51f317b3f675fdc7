"""Facts read from a cubin (an ELF file): per-kernel registers, stack frame, parameter info.

Read directly from the ELF so the build needs no CUDA toolkit: the global .nv.info section holds per-kernel
records (register count, stack frame) keyed by the kernel's symbol index, and .nv.info.<kernel> holds the
kernel's own records (KPARAM_INFO: each param's ordinal, offset and size).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# .nv.info attribute ids (cuobjdump -elf names them EIATTR_*).
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_KPARAM_INFO = 0x17
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F

# .nv.info record formats: no value, byte value, half-word value, sized value.
EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL, EIFMT_SVAL = 1, 2, 3, 4


class CubinError(ValueError):
    pass


@dataclass(frozen=True)
class KernelInfo:
    name: str
    registers: int
    frame_bytes: int  # per-thread local memory: spills or local arrays
    max_stack_bytes: int
    shared_static_bytes: int
    param_sizes: list[int]  # from KPARAM_INFO, in ordinal order


def _sections(data: bytes) -> dict[str, tuple[int, int, int, int]]:
    """name -> (offset, size, sh_info, sh_type) of every section of a 64-bit little-endian ELF."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise CubinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = []
    for i in range(shnum):
        name, sh_type, _flags, _addr, off, size, _link, info = struct.unpack_from(
            "<IIQQQQII", data, shoff + i * shentsize)
        headers.append((name, sh_type, off, size, info))
    str_off, str_size = headers[shstrndx][2], headers[shstrndx][3]
    names = data[str_off:str_off + str_size]
    out = {}
    for name, sh_type, off, size, info in headers:
        end = names.index(b"\0", name)
        out[names[name:end].decode()] = (off, size, info, sh_type)
    return out


def _attributes(blob: bytes):
    """(attribute, value or payload) records. Every record starts with 4 bytes: format, attribute, u16; for a
    sized value the u16 is the payload length and the payload follows, otherwise the u16 is the value."""
    pos = 0
    while pos + 4 <= len(blob):
        fmt, attr, half = blob[pos], blob[pos + 1], struct.unpack_from("<H", blob, pos + 2)[0]
        pos += 4
        if fmt == EIFMT_SVAL:
            yield attr, blob[pos:pos + half]
            pos += half
        elif fmt in (EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL):
            yield attr, half
        else:
            raise CubinError(f".nv.info record with unknown format {fmt:#x} at byte {pos - 4}")


def _symbols(data: bytes, secs) -> dict[int, str]:
    """symbol index -> name, from .symtab / .strtab."""
    if ".symtab" not in secs or ".strtab" not in secs:
        return {}
    off, size, _, _ = secs[".symtab"]
    str_off = secs[".strtab"][0]
    out = {}
    for i in range(size // 24):
        st_name, = struct.unpack_from("<I", data, off + 24 * i)
        end = data.index(b"\0", str_off + st_name)
        out[i] = data[str_off + st_name:end].decode()
    return out


def _per_symbol(payload: bytes) -> tuple[int, int]:
    """Global .nv.info records name their kernel by symbol index: (symbol, value)."""
    return struct.unpack_from("<II", payload, 0)


def kernels(data: bytes) -> list[KernelInfo]:
    secs = _sections(data)
    symbols = _symbols(data, secs)
    # Per-kernel facts in the global .nv.info, keyed by the kernel's symbol name.
    regs: dict[str, int] = {}
    frame: dict[str, int] = {}
    max_stack: dict[str, int] = {}
    if ".nv.info" in secs:
        off, size, _, _ = secs[".nv.info"]
        for attr, payload in _attributes(data[off:off + size]):
            if not isinstance(payload, bytes) or len(payload) < 8:
                continue
            sym, value = _per_symbol(payload)
            name = symbols.get(sym, f"#{sym}")
            if attr == EIATTR_REGCOUNT:
                regs[name] = value
            elif attr == EIATTR_FRAME_SIZE:
                frame[name] = value
            elif attr == EIATTR_MAX_STACK_SIZE:
                max_stack[name] = value
    out = []
    for sec in secs:
        if not sec.startswith(".text."):
            continue
        name = sec[len(".text."):]
        params: dict[int, int] = {}
        if f".nv.info.{name}" in secs:
            ioff, isize, _, _ = secs[f".nv.info.{name}"]
            for attr, payload in _attributes(data[ioff:ioff + isize]):
                if attr == EIATTR_KPARAM_INFO and isinstance(payload, bytes) and len(payload) >= 12:
                    # index u32, ordinal u16, offset u16, then flags: size in bytes in bits 18..31.
                    _index, ordinal, _offset, flags = struct.unpack_from("<IHHI", payload, 0)
                    params[ordinal] = (flags >> 18) & 0x3FFF
        shared = secs.get(f".nv.shared.{name}", (0, 0, 0, 0))[1]
        out.append(KernelInfo(name, regs.get(name, 0), frame.get(name, 0), max_stack.get(name, 0), shared,
                              [params[i] for i in sorted(params)]))
    return out
