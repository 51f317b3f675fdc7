"""The few CUDA driver calls the runtime makes, through cuda-python, with errors turned into LaunchError.

Imported lazily by the loader so that `import flash_msa_rt` works (and can explain itself) on a machine
without a CUDA driver.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

from flash_msa_rt.errors import LaunchError


@lru_cache(maxsize=1)
def cu():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 keeps the old module path
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


def check(result, what: str):
    """cuda-python returns (CUresult, *values); raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        d = cu()
        _, name = d.cuGetErrorName(err)
        _, text = d.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        text = text.decode() if isinstance(text, bytes) else text
        raise LaunchError(f"{what} failed: {name} ({text})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@lru_cache(maxsize=1)
def driver_version() -> int:
    return int(check(cu().cuDriverGetVersion(), "cuDriverGetVersion"))


def ensure_context(device_index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    d = cu()
    ctx = check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        dev = check(d.cuDeviceGet(device_index), "cuDeviceGet")
        ctx = check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


# CUDA 13 is the toolchain that builds the cubins (nvidia-cutlass-dsl[cu13]); its driver is R580 (13.0).
MIN_DRIVER = 13000

# Why cuLibraryLoadData refuses a cubin, by CUresult name: the three causes a user can act on.
_TOO_OLD = ("CUDA_ERROR_INSUFFICIENT_DRIVER", "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
            "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE")
_NO_BINARY = ("CUDA_ERROR_NO_BINARY_FOR_GPU",)
_INVALID = ("CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_INVALID_SOURCE", "CUDA_ERROR_INVALID_PTX")


def load_library(image: bytes):
    """Load a cubin; a refusal names its cause: driver too old, no binary for this GPU, or an image this driver
    cannot read."""
    d = cu()
    err, *values = d.cuLibraryLoadData(image, [], [], 0, [], [], 0)
    if int(err) == 0:
        return values[0]
    _, name = d.cuGetErrorName(err)
    name = name.decode() if isinstance(name, bytes) else str(getattr(name, "name", name))
    raise LaunchError(load_error_message(name, driver_text(), *current_device()))


def load_error_message(error: str, driver: str, device: str, capability: tuple[int, int] | None) -> str:
    """The message for a cubin the driver refused with CUresult `error`; driver is the CUDA version it supports
    ("13.0", or "?"), device and capability those of the current context's GPU (capability None if unknown)."""
    from flash_msa_rt.arch import arch_candidates, install_hint, RUNS_ON
    from flash_msa_rt.errors import UnsupportedArchError

    need = "the cubins are built by the CUDA 13 toolchain and need a driver for CUDA 13 (R580) or newer"
    old_driver = driver != "?" and _driver_number(driver) < MIN_DRIVER
    if error in _TOO_OLD or (error in _INVALID and old_driver):
        return (f"cuLibraryLoadData failed: {error}: the NVIDIA driver is too old (it supports CUDA {driver}); "
                f"{need}. Update the driver")
    if error in _NO_BINARY:
        runs = "; ".join(f"{a} on {where}" for a, where in RUNS_ON.items())
        text = f"cuLibraryLoadData failed: {error}: {device} cannot run this cubin (cubins run only where built: {runs})"
        if capability is None:
            return text
        try:
            arch = arch_candidates(*capability, device)[0]
        except UnsupportedArchError as e:
            return f"{text}. {e}"
        return f"{text}. This GPU needs {arch}: {install_hint(arch)}"
    if error in _INVALID:
        return (f"cuLibraryLoadData failed: {error}: the driver (CUDA {driver}) cannot read this cubin image; {need}. "
                f"With a current driver the artifact is damaged or foreign: reinstall the package, or rebuild it")
    return f"cuLibraryLoadData failed: {error} (driver for CUDA {driver}, {device})"


def _driver_number(text: str) -> int:
    major, _, minor = text.partition(".")
    return int(major) * 1000 + int(minor or 0) * 10


def driver_text() -> str:
    """The CUDA version the driver supports, e.g. "13.0"; "?" if the driver cannot say."""
    try:
        v = driver_version()
    except LaunchError:
        return "?"
    return f"{v // 1000}.{v % 1000 // 10}"


def current_device() -> tuple[str, tuple[int, int] | None]:
    """The current context's GPU: ('NAME (compute capability X.Y)', (X, Y)), or ('this GPU', None)."""
    d = cu()
    try:
        dev = check(d.cuCtxGetDevice(), "cuCtxGetDevice")
        raw = check(d.cuDeviceGetName(256, dev), "cuDeviceGetName")
        attr = d.CUdevice_attribute
        major = int(check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attr"))
        minor = int(check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attr"))
    except (LaunchError, AttributeError, TypeError):
        return "this GPU", None
    name = raw.split(b"\0", 1)[0].decode() if isinstance(raw, bytes) else str(raw)
    return f"{name} (compute capability {major}.{minor})", (major, minor)


def get_function(library, entry: str):
    d = cu()
    kernel = check(d.cuLibraryGetKernel(library, entry.encode()), f"cuLibraryGetKernel({entry[:40]}...)")
    return check(d.cuKernelGetFunction(kernel), "cuKernelGetFunction")


def set_dynamic_smem(func, nbytes: int) -> None:
    d = cu()
    attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(d.cuFuncSetAttribute(func, attr, nbytes), f"setting {nbytes} bytes of dynamic shared memory")


def allow_non_portable_cluster(func) -> None:
    d = cu()
    attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    check(d.cuFuncSetAttribute(func, attr, 1), "allowing a non-portable cluster size")


def param_sizes(func, count: int) -> list[int]:
    d = cu()
    return [int(check(d.cuFuncGetParamInfo(func, i), "cuFuncGetParamInfo")[1]) for i in range(count)]


def param_count_exceeds(func, count: int) -> bool:
    """True when the function has a param at index `count` (so more params than declared)."""
    err, *_ = cu().cuFuncGetParamInfo(func, count)
    return int(err) == 0


def launch_config(grid, block, smem: int, cluster):
    d = cu()
    cfg = d.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    if tuple(cluster) != (1, 1, 1):
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
        cfg.attrs = [attr]
        cfg.numAttrs = 1
    else:
        cfg.numAttrs = 0
    return cfg


def launch(cfg, func, params_address: int) -> None:
    err, = cu().cuLaunchKernelEx(cfg, func, params_address, 0)
    if int(err) != 0:
        check((err,), "cuLaunchKernelEx")


# cuTensorMapEncodeTiled enums, by the names the manifest uses.
_SWIZZLE = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
            128: "CU_TENSOR_MAP_SWIZZLE_128B"}
_L2 = {0: "CU_TENSOR_MAP_L2_PROMOTION_NONE", 64: "CU_TENSOR_MAP_L2_PROMOTION_L2_64B",
       128: "CU_TENSOR_MAP_L2_PROMOTION_L2_128B", 256: "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"}
_OOB = {"none": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE", "nan": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA"}


def encode_tiled(dst: int, dtype_code: int, address: int, dims, strides_bytes, box, swizzle: int, l2: int,
                 oob: str, span_bytes: int) -> None:
    """Encode a tiled TMA descriptor with cuTensorMapEncodeTiled and copy its 128 bytes to address dst."""
    d = cu()
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    tmap = check(d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType(dtype_code), len(dims), address,
        [u64(x) for x in dims], [u64(x) for x in strides_bytes], [u32(x) for x in box],
        [u32(1)] * len(dims),
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(d.CUtensorMapSwizzle, _SWIZZLE[swizzle]),
        getattr(d.CUtensorMapL2promotion, _L2[l2]),
        getattr(d.CUtensorMapFloatOOBfill, _OOB[oob])), "cuTensorMapEncodeTiled")
    ctypes.memmove(dst, tmap.getPtr(), 128)
    # Driver bug workaround CUTLASS applies (cute/atom/copy_traits_sm90_tma.hpp): on drivers up to 13.1, clear
    # bit 21 of the descriptor's second 64-bit word for tensors spanning under 128 KiB.
    if driver_version() <= 13010 and span_bytes < 131072:
        word = ctypes.c_uint64.from_address(dst + 8)
        word.value &= ~(1 << 21)
