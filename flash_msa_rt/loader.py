"""Load compiled variants lazily and launch them on torch's current stream.

    kernel = get_kernel("block_scores", {"dtype": "bf16", "head_dim": 128, ...}, device)
    kernel(q_proxy=q, k_proxy=k, scores=out, scale=0.088, group=8)

Nothing here synchronises the host with the device, so launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from typing import Any

from flash_msa_rt import artifacts, driver
from flash_msa_rt.arch import arch_for_capability
from flash_msa_rt.errors import FlashMsaError, LaunchError, NoGPUError
from flash_msa_rt.grid import compile_rule
from flash_msa_rt.manifest import ScalarParam, TensorParam, TmaParam, VariantEntry
from flash_msa_rt.params import Packed, Plan, launch_signature

# Packed param buffers kept per kernel: enough for the distinct activations of a training step's layers.
POINTER_CACHE_SIZE = 256
PLAN_CACHE_SIZE = 64


class Kernel:
    """One variant on one device: its function handle and every cached launch signature."""

    def __init__(self, entry: VariantEntry, device_index: int, arch_dir):
        self.entry = entry
        self.device_index = device_index
        self._grid_rules = [compile_rule(r) for r in entry.grid]
        self._arg_names = tuple(dict.fromkeys(
            [p.name for p in entry.params if isinstance(p, (TensorParam, ScalarParam))]
            + [p.tensor for p in entry.params if isinstance(p, TmaParam)]))
        scalars = {p.name for p in entry.params if isinstance(p, ScalarParam)}
        self._tensor_names = tuple(n for n in self._arg_names if n not in scalars)
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._packed: OrderedDict[tuple, Packed] = OrderedDict()
        image = artifacts.cubin_bytes(entry, arch_dir)
        with _bound_device(device_index):
            try:
                self._library = driver.load_library(image)
            except LaunchError as e:
                raise LaunchError(
                    f"{entry.name}: the driver (CUDA {_version_text(driver.driver_version())}) could not load the "
                    f"cubin ({e}). The artifacts are SASS built by nvidia-cutlass-dsl's CUDA 13 toolchain: they need "
                    f"a CUDA 13 driver (R580 or newer) and a GPU of arch {entry.arch}") from e
            self._func = driver.get_function(self._library, entry.entry)
            self._check_params()
            if entry.smem_bytes:
                driver.set_dynamic_smem(self._func, entry.smem_bytes)
            if tuple(entry.cluster) != (1, 1, 1):
                driver.allow_non_portable_cluster(self._func)

    def _check_params(self) -> None:
        want = [p.size for p in self.entry.params]
        got = driver.param_sizes(self._func, len(want))
        if got != want or driver.param_count_exceeds(self._func, len(want)):
            raise LaunchError(f"{self.entry.name}: the loaded kernel's params {got} do not match the manifest's "
                              f"ABI {want}; the artifact is inconsistent, rebuild it")

    def __call__(self, stream: int | None = None, **args: Any) -> None:
        """Launch with named tensors and scalars on the current torch stream (or `stream`, a CUstream int)."""
        try:
            key = launch_signature(self._arg_names, args)
            packed = self._packed.get(key)
        except KeyError:
            missing = [n for n in self._arg_names if n not in args]
            raise TypeError(f"{self.entry.op}: missing arguments {missing}; this kernel takes "
                            f"{list(self._arg_names)}") from None
        except (AttributeError, TypeError):  # not a tensor where one belongs, or unhashable: validation says which
            key = packed = None
        if packed is None:
            packed = self._prepare(key, args)
        else:
            self._packed.move_to_end(key)
        cfg = packed.config
        cfg.hStream = stream if stream is not None else current_stream(self.device_index)
        driver.launch(cfg, self._func, packed.address)

    def _prepare(self, key: tuple | None, args: dict[str, Any]) -> Packed:
        for n in self._tensor_names:
            dev = args[n].device if hasattr(args[n], "device") else None
            if dev is not None and (dev.type != "cuda" or dev.index != self.device_index):
                raise ValueError(f"{self.entry.op}: argument {n} is on {dev}; this launch runs on "
                                 f"cuda:{self.device_index} (all tensors must share one device)")
        layout = key[0] if key is not None else None
        plan = self._plans.get(layout) if layout is not None else None
        if plan is None:
            plan = Plan(self.entry, args, self._grid_rules, self.entry.op)
            if layout is not None:
                self._plans[layout] = plan
                if len(self._plans) > PLAN_CACHE_SIZE:
                    self._plans.popitem(last=False)
        packed = Packed(plan, args, driver.encode_tiled)
        packed.config = driver.launch_config(plan.grid, self.entry.block, self.entry.smem_bytes, self.entry.cluster)
        if key is not None:  # arguments that cannot be keyed are launched, never cached
            self._packed[key] = packed
            if len(self._packed) > POINTER_CACHE_SIZE:
                self._packed.popitem(last=False)
        return packed


def _version_text(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def current_stream(device_index: int) -> int:
    """torch's current stream on the device, as the CUstream handle the driver takes: torch's raw getter (the one
    Triton's launchers call) where this torch has it; torch.cuda.current_stream makes a Stream object per call, and
    this runs once per launch."""
    global _raw_stream
    if _raw_stream is None:
        import torch

        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda index: torch.cuda.current_stream(index).cuda_stream)
    return _raw_stream(device_index)


_raw_stream = None


@contextlib.contextmanager
def _bound_device(device_index: int):
    """The device current for torch and its primary context current for the driver (cuda-python)."""
    import torch

    with torch.cuda.device(device_index):
        torch.cuda.current_stream()  # initialises torch's context on this device
        driver.ensure_context(device_index)
        yield


_kernels: dict[tuple[str, int], Kernel] = {}
_by_request: dict[tuple, Kernel] = {}
_lock = threading.Lock()


def device_arch(device_index: int) -> str:
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA device is available (torch.cuda.is_available() is False); flash-msa kernels "
                         "run on NVIDIA GPUs of compute capability 9.0 (sm90a) or 10.x (sm100a / sm100f)")
    major, minor = torch.cuda.get_device_capability(device_index)
    return arch_for_capability(major, minor, artifacts.carried_archs(), torch.cuda.get_device_name(device_index))


def _built(arch: str) -> tuple:
    """(index, memo) of the arch's manifest: the variants by (op, their config as a set of named fields), a lookup
    that does not depend on the order in which the build declares a family's fields; memo keeps built_values'
    answers (asked on hot paths) for as long as the manifest is the current one."""
    where = (os.environ.get(artifacts.ENV_ARTIFACT_DIR), os.getcwd())
    root = _roots.get(where)
    if root is None:  # resolving the folder reads the file system: once per setting, not per call
        root = _roots[where] = artifacts.artifact_root()
    manifest = artifacts.load_manifest(root, arch)
    known = _indexes.get((root, arch))
    if known is None or known[0] is not manifest:  # a manifest reloaded (tests clear load_manifest's cache)
        index = {(v.op, _key(v.config)): v for v in manifest.variants.values()}
        known = _indexes[(root, arch)] = (manifest, index, {})
    return known[1], known[2]


def _key(config: dict[str, Any]) -> frozenset:
    return frozenset(config.items())


_indexes: dict[tuple, tuple] = {}  # (root, arch) -> (manifest, its index, built_values' answers)
_roots: dict[tuple, object] = {}  # (FLASH_MSA_ARTIFACT_DIR, working directory) -> the artifact root


def find_variant(op: str, config: dict[str, Any], arch: str):
    """(entry, arch folder) of the built variant of op whose config has exactly these named fields; raises
    MissingVariantError naming the nearest built variants and the build command when there is none."""
    entry = _built(arch)[0].get((op, _key(config)))
    if entry is None:
        return artifacts.find_variant(op, config, arch)  # raises with the nearest variants and the build command
    artifacts.check_fresh(entry)
    return entry, artifacts.artifact_root() / arch  # a cold path: the loaded kernel is cached by request


def built_values(op: str, field: str, arch: str, **fixed: Any) -> tuple:
    """The values of config field `field` among the variants of op built for arch whose other named fields equal
    `fixed`, ascending: what the runtime can run, read from the manifest (no artifacts: empty)."""
    try:
        index, memo = _built(arch)
    except FlashMsaError:
        return ()
    key = (op, field, tuple(sorted(fixed.items())))
    values = memo.get(key)
    if values is None:
        values = memo[key] = tuple(sorted({
            v.config[field] for (o, _), v in index.items()
            if o == op and field in v.config and all(v.config.get(k) == want for k, want in fixed.items())}))
    return values


def get_kernel(op: str, config: dict[str, Any], device) -> Kernel:
    """The loaded kernel for (op, config) on the device of `device` (a torch.device or index)."""
    index = device if isinstance(device, int) else (device.index if device.index is not None else _current())
    request = (op, tuple(config.items()), index)
    kernel = _by_request.get(request)
    if kernel is not None:  # the hot path: one dict lookup per call
        return kernel
    arch = device_arch(index)
    entry, arch_dir = find_variant(op, config, arch)
    key = (entry.name, index)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = Kernel(entry, index, arch_dir)
                _kernels[key] = kernel
    _by_request[request] = kernel
    return kernel


def _current() -> int:
    import torch

    return torch.cuda.current_device()
