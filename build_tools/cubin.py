"""Facts read from a cubin (an ELF file): per-kernel registers, stack frame, parameter info.

Read directly from the ELF so the build needs no CUDA toolkit: the register count sits in the top byte of the
.text.<kernel> section's sh_info, and .nv.info.<kernel> holds attribute records (format byte, attribute byte,
then a payload whose width the format gives).
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
    pos = 0
    while pos + 2 <= len(blob):
        fmt, attr = blob[pos], blob[pos + 1]
        pos += 2
        if fmt == EIFMT_NVAL:
            yield attr, b""
        elif fmt == EIFMT_BVAL:
            yield attr, blob[pos:pos + 1]
            pos += 1
        elif fmt == EIFMT_HVAL:
            yield attr, blob[pos:pos + 2]
            pos += 2
        elif fmt == EIFMT_SVAL:
            size, = struct.unpack_from("<H", blob, pos)
            yield attr, blob[pos + 2:pos + 2 + size]
            pos += 2 + size
        else:
            raise CubinError(f".nv.info record with unknown format {fmt:#x}")


def kernels(data: bytes) -> list[KernelInfo]:
    secs = _sections(data)
    out = []
    for sec, (off, size, info, _t) in secs.items():
        if not sec.startswith(".text."):
            continue
        name = sec[len(".text."):]
        registers = info >> 24
        frame = max_stack = 0
        params: dict[int, int] = {}
        if f".nv.info.{name}" in secs:
            ioff, isize, _, _ = secs[f".nv.info.{name}"]
            for attr, payload in _attributes(data[ioff:ioff + isize]):
                if attr == EIATTR_FRAME_SIZE and len(payload) >= 8:
                    frame = struct.unpack_from("<I", payload, 4)[0]
                elif attr == EIATTR_MAX_STACK_SIZE and len(payload) >= 8:
                    max_stack = struct.unpack_from("<I", payload, 4)[0]
                elif attr == EIATTR_REGCOUNT and len(payload) >= 8:
                    registers = struct.unpack_from("<I", payload, 4)[0]
                elif attr == EIATTR_KPARAM_INFO and len(payload) >= 12:
                    ordinal, _offset, flags = struct.unpack_from("<HHI", payload, 4)
                    params[ordinal] = (flags >> 18) & 0x3FFF
        shared = secs.get(f".nv.shared.{name}", (0, 0, 0, 0))[1]
        out.append(KernelInfo(name, registers, frame, max_stack, shared, [params[i] for i in sorted(params)]))
    return out
