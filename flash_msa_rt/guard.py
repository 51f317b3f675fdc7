"""The first-use guard: cubins of an arch never run on its hardware prove themselves before they produce numbers.

Each manifest records whether its arch's cubins have run the self-test on real hardware (hardware_verified, written
by the build from build_tools.build.HARDWARE_VERIFIED_ARCHS: sm90a yes, sm100a / sm100f not yet). On an unverified
arch, the first time dispatch resolves an op of a family (select, msa, msa_deterministic, warmup, block_sparse) in a
dtype and shape on a device, this module runs that family's slice (flash_msa_rt.selftest.slices: one small problem
against the float64 reference) at that shape before the op's work is enqueued. The shape is the head dims and key
block (slices.Shape): a model at D 64 or with blocks of 64 launches other cubins than the default D 128 / Bs 128, so
those prove themselves. It synchronises with the device: the one documented exception to "no host sync inside forward
or backward", once per process, family, dtype and shape. A pass is remembered on disk per (driver version, device
name and UUID, arch, manifest sha256), so later processes skip the slice; a failure sends that family (at that
shape) to the pure-PyTorch reference for the rest of the process with one warning naming the failure and
`python -m flash_msa_rt selftest`.

    FLASH_MSA_GUARD=warn    (default) a failing family falls back to the reference, with one warning
    FLASH_MSA_GUARD=raise   a failing family raises GuardFailure
    FLASH_MSA_GUARD=off     no guard: unverified cubins run unchecked
    FLASH_MSA_GUARD_UNVERIFIED=sm90a[,sm100a]   treat these archs as unverified (tests; a doubted install)

Under CUDA graph capture a slice cannot run (it synchronises): an unproven family raises GuardCaptureError asking
for one step outside capture first; a family proven earlier (in this process or on disk) is captured normally.
Manifests written before hardware_verified existed count as verified for sm90a only (the one arch those builds had
run on hardware).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from flash_msa_rt import artifacts, driver, loader
from flash_msa_rt.errors import FlashMsaError

ENV_MODE = "FLASH_MSA_GUARD"
ENV_UNVERIFIED = "FLASH_MSA_GUARD_UNVERIFIED"
MODES = ("warn", "raise", "off")
SELFTEST_COMMAND = "python -m flash_msa_rt selftest"
# Manifests without hardware_verified predate it; of their archs only sm90a's cubins had run on hardware.
VERIFIED_BEFORE_THE_FIELD = ("sm90a",)
_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "f16"}


class GuardFailure(FlashMsaError, RuntimeError):
    """A kernel family failed its first-use check on this GPU (FLASH_MSA_GUARD=raise)."""


class GuardCaptureError(FlashMsaError, RuntimeError):
    """An unproven kernel family was first used inside CUDA graph capture."""


@dataclass(frozen=True)
class Identity:
    """What a pass on disk is valid for: the driver, the GPU, and the artifact set."""

    driver: int
    device: str
    uuid: str
    arch: str
    artifacts: str  # sha256 of the arch's manifest.json (it records every cubin's sha256)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:32]


_verdicts: dict[tuple[int, str], str | None] = {}  # (device index, unit) -> None (admitted) or the failure
_lock = threading.RLock()
_suspended = 0
slices_run: list[tuple[int, str, float]] = []  # (device, unit, seconds) of every slice this process ran


def mode() -> str:
    value = os.environ.get(ENV_MODE, "warn").strip().lower() or "warn"
    if value not in MODES:
        raise ValueError(f"{ENV_MODE}={os.environ.get(ENV_MODE)!r}: expected one of {', '.join(MODES)}")
    return value


def forced_unverified() -> set[str]:
    return {a.strip() for a in os.environ.get(ENV_UNVERIFIED, "").split(",") if a.strip()}


def unverified(arch: str) -> bool:
    """Whether arch's installed cubins were never verified on hardware (or are force-marked so)."""
    if arch in forced_unverified():
        return True
    try:
        manifest = artifacts.load_manifest(artifacts.artifact_root(), arch)
    except FlashMsaError:  # no artifacts: the kernel backend declines every problem before the guard is asked
        return False
    verified = manifest.hardware_verified
    if verified is None:
        verified = arch in VERIFIED_BEFORE_THE_FIELD
    return not verified


def family(op: str, config) -> str | None:
    """The guard family of a dispatch op: the slice that proves its kernels."""
    if op == "select_blocks":
        return "select"
    if op in ("msa_forward", "msa_backward", "msa_kl"):
        return "msa_deterministic" if op == "msa_backward" and config.get("deterministic") else "msa"
    if op.startswith("warmup_"):
        return "warmup"
    if op.startswith("block_sparse_"):
        return "block_sparse"
    return None


def shape_of(op: str, config):
    """The slice shape (flash_msa_rt.selftest.slices.Shape) whose cubins the op's config launches: selection
    depends on the proxy's Dp and the key block only, warmup on the head dims only, block-sparse attention on D
    and the key block; the others are canonical so that one unit covers each set of cubins."""
    from flash_msa_rt.selftest.slices import Shape

    d = config.get("head_dim") or config.get("proxy_head_dim") or Shape.D
    dp = config.get("proxy_head_dim") or min(d, Shape.Dp)
    bs = config.get("block_size") or Shape.Bs
    if op == "select_blocks":
        return Shape(dp, dp, bs)
    if op.startswith("warmup_"):
        return Shape(d, dp, Shape.Bs)
    if op.startswith("block_sparse_"):
        return Shape(d, min(d, Shape.Dp), bs)
    return Shape(d, dp, bs)


def unit_name(fam: str, dtype_name: str, shape=None) -> str:
    """"family/dtype", then the shape where it is not the default (flash_msa_rt.selftest.slices.Shape.suffix)."""
    return f"{fam}/{dtype_name}" + (shape.suffix() if shape is not None else "")


def split_unit(unit: str):
    """(family, dtype name, Shape) of a unit name."""
    from flash_msa_rt.selftest.slices import Shape

    fam, dt, *rest = unit.split("/", 2)
    return fam, dt, Shape.parse(rest[0] if rest else "")


def units(arch: str, dtype_name: str = "bf16", shape=None) -> list[str]:
    """Every guard unit of an arch in a dtype at a shape (default: D 128 / Dp 128 / Bs 128), the deterministic
    family where the arch has those kernels."""
    from flash_msa_rt.selftest.problems import DETERMINISTIC_ARCHS
    from flash_msa_rt.selftest.slices import SLICES

    return [unit_name(f, dtype_name, shape) for f in SLICES if f != "msa_deterministic" or arch in DETERMINISTIC_ARCHS]


def admit(problem) -> str | None:
    """Backend.guard of the kernel backend: None to run the problem on the kernels, else why not (this module has
    warned). Called by dispatch when it resolves a problem (not per call)."""
    if _suspended or problem.device.type != "cuda" or mode() == "off":
        return None
    fam = family(problem.op, problem.config)
    dt = _DTYPE_NAMES.get(str(problem.dtype))
    if fam is None or dt is None:
        return None
    index = problem.device.index if problem.device.index is not None else _current_device()
    return check_unit(index, unit_name(fam, dt, shape_of(problem.op, problem.config)))


def check_unit(index: int, unit: str) -> str | None:
    """The verdict for unit ("family/dtype[/shape]") on device `index`: decided once per process (a slice runs
    unless the arch is verified or a pass is on disk)."""
    key = (index, unit)
    if key in _verdicts:
        return _verdicts[key]
    arch = loader.device_arch(index)
    if not unverified(arch):
        _verdicts[key] = None
        return None
    with _lock:
        if key in _verdicts:
            return _verdicts[key]
        identity = device_identity(index, arch)
        if unit in passed_on_disk(identity):
            _verdicts[key] = None
            return None
        if _capturing():
            raise GuardCaptureError(
                f"flash_msa: the {arch} kernels of {unit} have never run on this GPU's hardware and must pass a "
                f"first-use check, which synchronises and so cannot run inside CUDA graph capture. Run one step "
                f"(forward and backward) outside capture first, then capture; or run `{SELFTEST_COMMAND}`, or set "
                f"{ENV_MODE}=off to skip the check.")
        failure, seconds = run_slice(index, unit)
        if failure is None:
            record_pass(identity, unit, seconds)
            _verdicts[key] = None
            return None
        fam, dt, shape = split_unit(unit)
        dt = dt + shape.suffix().replace("/", ", ")
        message = (f"flash_msa: the {arch} {fam} kernels ({dt}) failed their first-use check on {identity.device} "
                   f"(cuda:{index}; cubins never verified on {arch} hardware): {failure}. ")
        if mode() == "raise":
            raise GuardFailure(message + f"Run `{SELFTEST_COMMAND}` for the full report; {ENV_MODE}=warn falls back "
                                         f"to the reference instead.")
        warnings.warn(message + f"{fam} runs on the slow pure-PyTorch reference for the rest of this process. Run "
                                f"`{SELFTEST_COMMAND}` for the full report and please report it; {ENV_MODE}=off "
                                f"skips this check, {ENV_MODE}=raise makes it an error.", RuntimeWarning,
                      stacklevel=5)
        verdict = f"{fam} ({dt}) failed its first-use check on this GPU: {failure}"
        _verdicts[key] = verdict
        return verdict


def run_slice(index: int, unit: str) -> tuple[str | None, float]:
    """(None or what failed, seconds): the unit's slice on the kernel backend's ops, synchronised."""
    import torch

    from flash_msa_rt.ops import kernels
    from flash_msa_rt.selftest.slices import SLICES

    fam, dt, shape = split_unit(unit)
    fn = SLICES[fam][0]
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[dt]
    device = torch.device("cuda", index)
    t0 = time.perf_counter()
    try:
        with _on_device(index):
            comps = fn(kernels.KERNELS.ops, dtype, device, shape)
        bad = [c for c in comps if not c.ok]
        failure = "; ".join(f"{c.name}: {c.problem}" for c in bad[:3]) if bad else None
    except Exception as e:  # noqa: BLE001 - a crash is a failure of the family, reported by name
        failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    seconds = time.perf_counter() - t0
    slices_run.append((index, unit, seconds))
    return failure, seconds


# --- the disk cache ---------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """$XDG_CACHE_HOME/flash-msa, else ~/.cache/flash-msa (the XDG base directory rule: a relative value is
    ignored)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "flash-msa"


def cache_file(identity: Identity) -> Path:
    return cache_dir() / "guard" / f"{identity.key()}.json"


def passed_on_disk(identity: Identity) -> set[str]:
    try:
        data = json.loads(cache_file(identity).read_text())
        return set(data["passed"]) if data.get("identity") == asdict(identity) else set()
    except (OSError, ValueError, KeyError, TypeError):  # absent or unreadable: check again
        return set()


def record_pass(identity: Identity, unit: str, seconds: float) -> None:
    """Add unit to the identity's passes (atomically replaced; a read-only cache only costs a later re-check)."""
    path = cache_file(identity)
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        passed = data.get("passed", {}) if data.get("identity") == asdict(identity) else {}
    except (OSError, ValueError):
        passed = {}
    passed[unit] = {"seconds": round(seconds, 3), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    text = json.dumps({"identity": asdict(identity), "passed": passed}, indent=1, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass


def device_identity(index: int, arch: str) -> Identity:
    name, uuid = device_name_uuid(index)
    return Identity(driver.driver_version(), name, uuid, arch, artifacts.manifest_digest(arch))


def device_name_uuid(index: int) -> tuple[str, str]:
    import torch

    props = torch.cuda.get_device_properties(index)
    return props.name, str(getattr(props, "uuid", ""))


@contextlib.contextmanager
def _on_device(index: int):
    """The slice's device current, no autograd graph, and the device drained before the verdict."""
    import torch

    with torch.no_grad(), torch.cuda.device(index):
        yield
        torch.cuda.synchronize(index)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


# --- state -------------------------------------------------------------------------------------------------------

class suspended:
    """No guard inside (the self-test checks every family itself, with the numbers). Dispatch's resolutions made
    inside are forgotten on both edges, so none made unguarded outlives the block."""

    def __enter__(self):
        global _suspended
        with _lock:
            _suspended += 1
            _forget_resolutions()
        return self

    def __exit__(self, *exc):
        global _suspended
        with _lock:
            _suspended -= 1
            _forget_resolutions()
        return False


def _forget_resolutions() -> None:
    from flash_msa_rt.ops import backends

    backends._resolved.clear()


def reset() -> None:
    """Forget this process's verdicts (not the disk cache): flash_msa_rt.ops.dispatch.reset_warnings calls it."""
    with _lock:
        _verdicts.clear()
