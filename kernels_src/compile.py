"""The build's compile machinery (build time, in a build worker only: imports cutlass).

- fake arguments made from a family's declared param ABI (flash_msa_rt.manifest params), so a compile sees exactly
  what the runtime will pass: `fake_tensor`, `fake_params`;
- `compile_kernel`: one variant through cute.compile for an arch with no GPU present, keeping its PTX, cubin and
  ptxas's performance warnings (the build refuses those in a hot kernel: build_tools.build.check_compiled);
- `compile_declared`: compile_kernel on fake_params, then the traced shared memory checked against the spec;
- `check_traced`: the TMA descriptors and shared memory CuTeDSL traced for the proxy score tiles (block_scores,
  select) against the declared ABI.

Each family's `build.py` holds its `compile(config, arch)`: the kernel class a config picks, compiled here.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import tempfile
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from flash_msa_rt.manifest import TensorParam
from kernels_src.spec import GPU_ARCH_OPTION, Compiled

_FAKE_ELEMENTS = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16, "e4m3": cutlass.Float8E4M3FN, "f32": cutlass.Float32, "i32": cutlass.Int32,
                  "i64": cutlass.Int64, "u8": cutlass.Uint8}
_FAKE_SCALARS = {"f32": lambda: cutlass.Float32(1.0), "i32": lambda: cutlass.Int32(1), "i64": lambda: cutlass.Int64(1)}


def fake_tensor(param: TensorParam):
    """The CuTeDSL fake tensor a TensorParam declares: the compile sees exactly the runtime's ABI.

    Every symbolic extent becomes its own int32 sym_int (with the declared divisibility), so the cubin assumes
    nothing about two tensors sharing a size: the runtime binds symbols by name and checks equality itself.
    Dynamic strides become sym_ints of their declared width; static entries stay static.
    """
    shape = tuple(s if isinstance(s, int) else cute.sym_int(divisibility=param.divisibility.get(s, 1))
                  for s in param.shape)
    stride = tuple(s if isinstance(s, int) else cute.sym_int(64 if s == "i64" else 32) for s in param.stride)
    return make_fake_tensor(_FAKE_ELEMENTS[param.dtype], shape, stride, assumed_align=param.align)


def fake_params(params) -> tuple:
    """A fake argument per declared param in launch order (tensors of their declared shapes, scalars of their
    declared types), then a stream."""
    return (*(fake_tensor(p) if p.kind == "tensor" else _FAKE_SCALARS[p.ctype]() for p in params),
            make_fake_stream())


def compile_kernel(kernel, config, arch: str, fake_args, entry=None) -> Compiled:
    """Compile one variant for arch with no GPU present; returns SASS, PTX and the dynamic shared memory.

    PTX and cubin are kept through cute.compile's own --keep-ptx / --keep-cubin / --dump-dir options (no
    environment variables; keeping artifacts also turns CuTeDSL's compile cache off, so they are always fresh).
    entry: the jit function to compile when the kernel object has several (default: the object itself).
    """
    # remarks{ptx}: CuTeDSL runs ptxas verbose and reports its log on stderr, the only place ptxas's performance
    # warnings show (e.g. C7514, every wgmma serialised: kernels_src/select/NOTES.md); the build refuses them.
    log = io.StringIO()
    with tempfile.TemporaryDirectory(prefix=f"{type(kernel).__name__}_") as dump:
        options = f"--gpu-arch {GPU_ARCH_OPTION[arch]} --keep-ptx --keep-cubin --dump-dir {dump} remarks{{ptx}}"
        try:
            with contextlib.redirect_stderr(log):
                compiled = cute.compile(entry or kernel, *fake_args, options=options)
        except Exception:
            sys.stderr.write(log.getvalue())  # the compiler's own report of the failure
            raise
        ptx, cubin = compiled.__ptx__, compiled.__cubin__
        if not ptx or not cubin:  # fall back to the dump files
            files = {p.suffix: p for p in Path(dump).iterdir()}
            ptx = ptx or files[".ptx"].read_text()
            cubin = cubin or files[".cubin"].read_bytes()
    if isinstance(cubin, str):
        cubin = cubin.encode("latin-1")
    return Compiled(cubin=bytes(cubin), ptx=ptx, smem_bytes=kernel.traced["smem_bytes"],
                    ptxas_warnings=ptxas_performance_warnings(log.getvalue()))


def compile_declared(kernel, config, arch: str, params, smem_bytes: int, entry=None) -> Compiled:
    """compile_kernel on a fake argument per declared param (fake_params); the shared memory the kernel traced
    must be what the spec declares (the launcher allocates the spec's figure)."""
    compiled = compile_kernel(kernel, config, arch, fake_params(params), entry=entry)
    if kernel.traced["smem_bytes"] != smem_bytes:
        raise RuntimeError(f"shared memory: kernel {kernel.traced['smem_bytes']} bytes, spec {smem_bytes}")
    return compiled


# ptxas's performance warnings: "(C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized
# due to ...", "(C7512) ... due to insufficient register resources ...", "(C7517) wgmma.wait_group is injected ...".
_PTXAS_WARNING = re.compile(r"\((C75\d\d)\)\s*([^\n]*)")


def ptxas_performance_warnings(log: str) -> tuple[str, ...]:
    """The distinct "C75xx: text" warnings in a ptxas log, each cut before the kernel's (long) name."""
    found = set()
    for code, text in _PTXAS_WARNING.findall(log):
        for cut in (" for the function", " in the function", " in function"):
            text = text.split(cut)[0]
        found.add(f"{code}: {text.strip()}")
    return tuple(sorted(found))


_TMA_FORMAT = {"bf16": "BF16", "f16": "F16", "e4m3": "U8"}  # fp8: TMA moves bytes
_SWIZZLE_SPELLING = {128: "S<3,4,3>", 64: "S<2,4,3>"}  # 128B and 64B swizzle in CuTeDSL's byte-address spelling


def check_traced(config, traced: dict, declared: tuple) -> None:
    """The descriptor basis (tma_q, tma_k) and shared memory CuTeDSL chose for the proxy score tiles must be what
    the build spec declares."""
    decl = {p.name: p for p in declared}
    for name in ("tma_q", "tma_k"):
        m = re.search(r'tma_gbasis = <"\(([^)]*)\):\(([^)]*)\)">', traced[name])
        if not m:
            raise RuntimeError(f"{name}: no tma_gbasis in {traced[name]!r}")
        box = tuple(int(x) for x in m.group(1).split(","))
        dims = tuple(int(x.split("@")[1]) for x in m.group(2).split(","))
        unit = all(x.split("@")[0] == "1" for x in m.group(2).split(","))
        want = decl[name]
        if (dims, box) != (want.dims, want.box) or not unit:
            raise RuntimeError(f"{name}: CuTeDSL built basis {m.group(0)}, spec declares dims {want.dims} "
                               f"box {want.box}")
        if _TMA_FORMAT[config.dtype] not in traced[name]:
            raise RuntimeError(f"{name}: unexpected TMA format in {traced[name]!r}")
    swizzles = {decl[name].swizzle for name in ("tma_q", "tma_k")}
    want = _SWIZZLE_SPELLING.get(next(iter(swizzles))) if len(swizzles) == 1 else None
    if want is None or traced["swizzle"] != want:
        raise RuntimeError(f"smem swizzle {traced['swizzle']}, the spec declares {swizzles} bytes "
                           f"({_SWIZZLE_SPELLING})")
    if traced["smem_bytes"] != config.smem_bytes():
        raise RuntimeError(f"shared memory: kernel {traced['smem_bytes']} bytes, spec {config.smem_bytes()}")
