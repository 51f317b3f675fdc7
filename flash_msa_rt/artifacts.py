"""Find the artifacts, read and verify their manifests, and explain what is missing.

Artifacts live inside the installed package (flash_msa_rt/_artifacts/<arch>/), put there by the per-arch
distributions (flash-msa-rt-sm90a, ...; several install side by side) or by a source build; FLASH_MSA_ARTIFACT_DIR
points the runtime at another root (a source checkout's artifacts/, or a folder built for a new config).
"""

from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from flash_msa_rt import arch as arches
from flash_msa_rt.errors import ArtifactError, FlashMsaError, MissingVariantError
from flash_msa_rt.manifest import Manifest, ManifestError, VariantEntry, source_hash, variant_name

ENV_ARTIFACT_DIR = "FLASH_MSA_ARTIFACT_DIR"
PACKAGE_ARTIFACTS = Path(__file__).resolve().parent / "_artifacts"
# In a source checkout the kernel sources sit beside the runtime; artifacts are then checked against them.
SOURCE_KERNELS = Path(__file__).resolve().parent.parent / "kernels_src"

# Config fields the build CLI can widen the catalogue with, and its flag for each.
BUILD_FLAGS = {"dtype": "--dtype", "head_dim": "--head-dim", "block_size": "--block-size"}


def artifact_root() -> Path:
    env = os.environ.get(ENV_ARTIFACT_DIR)
    return Path(env).expanduser().resolve() if env else PACKAGE_ARTIFACTS


def carried_archs(root: Path | None = None) -> list[str]:
    root = root or artifact_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "manifest.json").is_file())


def build_command(arch: str, config: dict[str, Any] | None = None, name: str | None = None) -> str:
    parts = ["python -m build_tools build", f"--arch {arch}"]
    for field, flag in BUILD_FLAGS.items():
        if config and field in config:
            parts.append(f"{flag} {config[field]}")
    if name:
        parts.append(f"--only '{name}'")
    if os.environ.get(ENV_ARTIFACT_DIR) or SOURCE_KERNELS.is_dir():  # a checkout, or artifacts of one's own
        parts.append("--out artifacts")
        return " ".join(parts) + f"  (from a flash-msa source checkout; then export {ENV_ARTIFACT_DIR}=$PWD/artifacts)"
    parts.append("--into-installed")  # this pip-installed runtime then finds them where its own cubins are
    return " ".join(parts) + "  (from a flash-msa source checkout of this version, in this environment)"


@lru_cache(maxsize=None)
def load_manifest(root: Path, arch: str) -> Manifest:
    path = root / arch / "manifest.json"
    if not path.is_file():
        have = carried_archs(root)
        needing = [f"{name} (cuda:{i}, compute capability {major}.{minor})"
                   for i, name, major, minor in _torch_devices() if arch in _candidates(major, minor)]
        raise MissingVariantError(
            f"no {arch} artifacts in {root} (archs installed there: {', '.join(have) or 'none'})"
            + (f"; {' and '.join(needing)} run{'s' if len(needing) == 1 else ''} {arch} cubins" if needing else "")
            + f". Install them: {arches.install_hint(arch)}; or build them: {build_command(arch)}")
    try:
        manifest = Manifest.load(path)
    except ManifestError as e:
        raise ArtifactError(f"{path} is corrupt or from another flash-msa version: {e}. Rebuild: "
                            f"{build_command(arch)}") from e
    if manifest.arch != arch:
        raise ArtifactError(f"{path} describes arch {manifest.arch!r}, but sits in the {arch!r} folder")
    toolchain = manifest.fingerprint.get("cutlass_dsl")
    for v in manifest.variants.values():
        if not v.fingerprint.startswith(f"cutlass_dsl={toolchain};"):
            raise ArtifactError(f"{path}: variant {v.name} was built by another toolchain ({v.fingerprint!r}) "
                                f"than the manifest records (nvidia-cutlass-dsl {toolchain}); rebuild: "
                                f"{build_command(arch, v.config, v.name)}")
    return manifest


def manifest_digest(arch: str, root: Path | None = None) -> str:
    """sha256 of arch's manifest.json: it records every cubin's sha256, so it names the artifact set (the guard's
    disk cache is keyed by it: new cubins are checked again)."""
    path = (root or artifact_root()) / arch / "manifest.json"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise ArtifactError(f"{path} is unreadable ({e}); rebuild: {build_command(arch)}") from e


@lru_cache(maxsize=None)
def _source_family_hash(op: str) -> str | None:
    family = SOURCE_KERNELS / op
    return source_hash(family)[:16] if family.is_dir() else None


def check_fresh(entry: VariantEntry) -> None:
    """From a source checkout, refuse artifacts compiled from other kernel sources than the ones beside us."""
    current = _source_family_hash(entry.op)
    if current is None:
        return
    tag = f"src:kernels_src/{entry.op}="
    built = next((f[len(tag):] for f in entry.fingerprint.split(";") if f.startswith(tag)), None)
    if built != current:
        raise ArtifactError(
            f"{entry.name} was built from other sources than kernels_src/{entry.op} now holds (built {built}, "
            f"sources {current}); rebuild: {build_command(entry.arch, entry.config, entry.name)}")


def find_variant(op: str, config: dict[str, Any], arch: str) -> tuple[VariantEntry, Path]:
    root = artifact_root()
    manifest = load_manifest(root, arch)
    name = variant_name(op, config, arch)
    entry = manifest.variants.get(name)
    if entry is None:
        raise MissingVariantError(missing_message(name, op, config, arch, manifest, root))
    check_fresh(entry)
    return entry, root / arch


def missing_message(name: str, op: str, config: dict[str, Any], arch: str, manifest: Manifest, root: Path) -> str:
    same_op = [v for v in manifest.variants.values() if v.op == op]

    def distance(v: VariantEntry) -> int:
        return sum(v.config.get(k) != val for k, val in config.items())

    nearest = sorted(same_op, key=lambda v: (distance(v), v.name))[:5]
    lines = [f"variant {name} is not in {root / arch} (op {op}, config {config})."]
    if nearest:
        lines.append("nearest available: " + ", ".join(v.name for v in nearest))
    else:
        lines.append(f"no {op} variants were built for {arch}")
    lines.append(f"build it: {build_command(arch, config, name)}")
    return "\n".join(lines)


def cubin_bytes(entry: VariantEntry, arch_dir: Path) -> bytes:
    path = arch_dir / entry.cubin
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"cubin of {entry.name} is unreadable at {path} ({e}); rebuild: "
                            f"{build_command(entry.arch, entry.config, entry.name)}") from e
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise ArtifactError(f"cubin {path} is corrupt: sha256 {digest[:16]}... but the manifest records "
                            f"{entry.sha256[:16]}...; rebuild: {build_command(entry.arch, entry.config, entry.name)}")
    return data


def _candidates(major: int, minor: int) -> tuple[str, ...]:
    try:
        return arches.arch_candidates(major, minor)
    except FlashMsaError:
        return ()


def _torch_devices() -> list[tuple[int, str, int, int]]:
    """(index, name, major, minor) of torch's visible devices; none where torch is not imported yet (this module
    never imports it: the build stage and `import flash_msa_rt` run without it) or sees no GPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    return [(i, torch.cuda.get_device_name(i), *torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())]


def device_problems(devices: list[tuple[int, str, int, int]], root: Path | None = None) -> list[str]:
    """One message per device that no installed arch runs on (naming the GPU, its capability, the archs
    installed and the package to install)."""
    root = root or artifact_root()
    have = carried_archs(root)
    problems = []
    for index, name, major, minor in devices:
        why = arches.device_mismatch(f"{name} (cuda:{index})", major, minor, have, str(root))
        if why:
            problems.append(why)
    return problems


def check_devices() -> None:
    """Check every visible device (through torch) against the installed archs; raise MissingVariantError
    listing each device no installed arch runs on."""
    import torch  # noqa: F401 - _torch_devices reads torch from sys.modules

    problems = device_problems(_torch_devices())
    if problems:
        raise MissingVariantError("\n".join(problems))


def import_notice() -> str | None:
    """At `import flash_msa_rt`: when no arch is installed at all (the runtime alone, e.g. `pip install
    flash-msa-rt` without an extra) and NVIDIA GPUs are present, the packages they need; None otherwise (and
    without asking the driver when cubins are installed, so a normal import costs nothing)."""
    root = artifact_root()
    if carried_archs(root):
        return None
    gpus = arches.visible_gpus()
    problems = [arches.device_mismatch(name, major, minor, (), str(root)) for name, major, minor in gpus]
    problems = [p for p in problems if p]
    if not problems:
        return None
    return ("flash_msa_rt carries no kernels (the runtime alone is installed), so every op runs the pure-PyTorch "
            "reference. " + " ".join(problems))
