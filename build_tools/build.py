"""Compile build specs to cubins, check them, and record them in artifacts/<arch>/manifest.json.

Each variant compiles in its own worker process (CuTeDSL keeps global state and honours some settings only at
import). The parent process does every check and every write, so a crash in a worker cannot leave a half
written cubin or manifest behind: files are written to a temporary name and renamed into place.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import importlib.metadata
import json
import re
import multiprocessing
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from build_tools import cubin as cubin_facts
from build_tools import ptx as ptx_facts
from flash_msa_rt.manifest import Manifest, ManifestError, VariantEntry, param_layout, source_hash
from kernels_src.spec import BuildSpec, Compiled

REPO = Path(__file__).resolve().parent.parent
KERNELS_SRC = REPO / "kernels_src"
CUTLASS_DIST = "nvidia-cutlass-dsl"


# Archs whose cubins have run `python -m flash_msa_rt selftest` and the GPU test suite on real hardware: sm90a on
# an H200. Each manifest records whether its arch is listed (hardware_verified); on an arch that is not (sm100a,
# sm100f: no Blackwell GPU has run them yet) the runtime checks each kernel family on first use
# (flash_msa_rt.guard). Add an arch here once its selftest and GPU suite pass on hardware, then rebuild.
HARDWARE_VERIFIED_ARCHS = frozenset({"sm90a"})


class BuildError(RuntimeError):
    pass


def toolchain_version() -> str:
    try:
        return importlib.metadata.version(CUTLASS_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        pin = re.search(r'"(nvidia-cutlass-dsl[^"]*==[^"]+)"', (REPO / "pyproject.toml").read_text())
        raise BuildError(f"{CUTLASS_DIST} is not installed; it is the build stage's compiler: pip install "
                         f"'{pin.group(1) if pin else CUTLASS_DIST}' (the version pyproject.toml pins)") from e


def build_fingerprint() -> dict[str, str]:
    """The manifest-level fingerprint: exact CuTeDSL version + hash of all kernel sources."""
    return {"cutlass_dsl": toolchain_version(), "kernels_src_sha256": source_hash(KERNELS_SRC)}


_IMPORTED_FAMILY = re.compile(r"\bkernels_src\.(\w+)")
_IMPORT_STATEMENT = re.compile(r"^\s*(?:from|import)\s+kernels_src\.(\w+)", re.M)


def family_packages(op: str) -> list[str]:
    """The kernels_src packages a family's cubins depend on: its own and, transitively, every kernels_src package
    its sources import (select builds on block_scores' score tiles, sparse_kl on sparse_bwd_proxy's kernel
    class), and those kernels_src's top-level modules import (every family depends on those modules: see
    common_hash)."""
    shared = [name for f in sorted(KERNELS_SRC.glob("*.py")) for name in _IMPORT_STATEMENT.findall(f.read_text())]
    seen, todo = set(), [op, *shared]
    while todo:
        name = todo.pop()
        pkg = KERNELS_SRC / name
        if name in seen or not pkg.is_dir():
            continue
        seen.add(name)
        for f in sorted(pkg.rglob("*.py")):
            todo.extend(_IMPORTED_FAMILY.findall(f.read_text()))
    return sorted(seen)


def variant_fingerprint(spec: BuildSpec, toolchain: str, common: str) -> str:
    """What decides a variant's cubin: toolchain, shared build code, the sources of its family and of the
    families it imports, its spec."""
    spec_json = json.dumps(spec.entry().to_json(), sort_keys=True)
    sources = [f"src:kernels_src/{name}={source_hash(KERNELS_SRC / name)[:16]}" for name in family_packages(spec.op)]
    return ";".join([
        f"cutlass_dsl={toolchain}",
        f"common={common[:16]}",
        *sources,
        f"spec={hashlib.sha256(spec_json.encode()).hexdigest()[:16]}",
    ])


def common_hash() -> str:
    """Files every variant depends on: kernels_src's top-level modules, the manifest schema and the tile rules the
    build shares with the runtime (flash_msa_rt.tuning.head_dim)."""
    h = hashlib.sha256()
    for p in sorted(KERNELS_SRC.glob("*.py")) + [REPO / "flash_msa_rt" / "manifest.py",
                                                  REPO / "flash_msa_rt" / "tuning" / "head_dim.py"]:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


@dataclass
class Outcome:
    name: str
    arch: str
    status: str  # "built", "up-to-date", "failed", "pruned" (stale and not in the build: prune_stale)
    seconds: float = 0.0
    detail: str = ""


def _compile_in_worker(spec: BuildSpec) -> tuple[Compiled, float]:
    # Incremental builds are ours (fingerprints); CuTeDSL's own disk cache would only make a "full build"
    # partly a cache read. Set before cutlass is first imported in this fresh worker.
    os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")
    t0 = time.perf_counter()
    compiled = spec.compile()
    return compiled, time.perf_counter() - t0


def check_compiled(spec: BuildSpec, compiled: Compiled) -> dict:
    """Everything the build can verify without a GPU; returns the manifest fields only the build knows."""
    entry = ptx_facts.single_entry(compiled.ptx)
    declared = param_layout(spec.params)
    if entry.params != declared:
        raise BuildError(
            f"{spec.name}: PTX params (size, align) {entry.params} differ from the declared ABI {declared} "
            f"({[p.name for p in spec.params]})")
    infos = cubin_facts.kernels(compiled.cubin)
    matching = [k for k in infos if k.name == entry.name]
    if len(infos) != 1 or not matching:
        raise BuildError(f"{spec.name}: cubin holds kernels {[k.name for k in infos]}, expected only {entry.name}")
    info = matching[0]
    if info.param_sizes and info.param_sizes != [s for s, _ in declared]:
        raise BuildError(f"{spec.name}: cubin KPARAM_INFO sizes {info.param_sizes} differ from the declared ABI")
    if spec.hot and info.frame_bytes:
        raise BuildError(f"{spec.name}: hot kernel uses {info.frame_bytes} bytes of local memory per thread "
                         f"(register spills or local arrays); fix the kernel or its register budget")
    if spec.hot and compiled.ptxas_warnings:
        raise BuildError(f"{spec.name}: ptxas warns of lost performance in a hot kernel: "
                         f"{'; '.join(compiled.ptxas_warnings)}; fix the kernel (causes seen here: a wgmma group waited for "
                         f"in a later loop step than the one that issued it, C7514, kernels_src/select/NOTES.md; too "
                         f"few registers under a launch bound, C7512, kernels_src/sparse_fwd/NOTES.md)")
    if compiled.smem_bytes is not None and compiled.smem_bytes != spec.smem_bytes:
        raise BuildError(f"{spec.name}: the compiled host code asks for {compiled.smem_bytes} bytes of dynamic "
                         f"shared memory, the spec declares {spec.smem_bytes}")
    return {"entry": entry.name, "registers": info.registers, "local_bytes": info.frame_bytes}


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_manifest(arch_dir: Path, arch: str, fingerprint: dict[str, str]) -> Manifest:
    """The existing manifest of arch_dir, or an empty one; entries from another toolchain are dropped."""
    path = arch_dir / "manifest.json"
    variants: dict[str, VariantEntry] = {}
    if path.exists():
        try:
            old = Manifest.load(path)
            if old.arch == arch:
                tag = f"cutlass_dsl={fingerprint['cutlass_dsl']};"
                variants = {n: v for n, v in old.variants.items() if v.fingerprint.startswith(tag)}
        except ManifestError:
            variants = {}  # unreadable: rebuild everything it described
    return Manifest(arch=arch, fingerprint=dict(fingerprint), variants=variants,
                    hardware_verified=arch in HARDWARE_VERIFIED_ARCHS)


def stale_sources(entry: VariantEntry) -> list[str]:
    """The kernels_src families whose sources changed (or went) since entry was compiled from them: the runtime
    refuses such a variant from this checkout (artifacts.check_fresh), and a wheel would ship a dead cubin."""
    tag = "src:kernels_src/"
    recorded = [f[len(tag):].split("=", 1) for f in entry.fingerprint.split(";") if f.startswith(tag)]
    return [name for name, digest in recorded
            if not (KERNELS_SRC / name).is_dir() or source_hash(KERNELS_SRC / name)[:16] != digest]


def prune_stale(manifest: Manifest, arch_dir: Path, keep: set[str]) -> list[str]:
    """Drop from manifest, and delete the files of, every variant outside keep that was compiled from kernel
    sources this checkout no longer holds (a variant the catalogue renamed or dropped, e.g. at other stages, or
    one built with --head-dim 64 before its family changed). Variants in keep are the build's to rebuild. Returns
    the dropped names."""
    dropped = sorted(n for n, v in manifest.variants.items() if n not in keep and stale_sources(v))
    for name in dropped:
        entry = manifest.variants.pop(name)
        (arch_dir / entry.cubin).unlink(missing_ok=True)
        (arch_dir / "ptx" / f"{name}.ptx").unlink(missing_ok=True)
    return dropped


def is_up_to_date(entry: VariantEntry | None, fingerprint: str, arch_dir: Path) -> bool:
    if entry is None or entry.fingerprint != fingerprint:
        return False
    path = arch_dir / entry.cubin
    return path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256


def build(specs: list[BuildSpec], out: Path, jobs: int = 1, force: bool = False, progress: bool = True,
          keep_ptx: bool = True) -> list[Outcome]:
    """Build specs into out/<arch>/; returns one outcome per spec. Raises nothing for a failed variant:
    callers decide (the CLI exits non-zero and lists them)."""
    fingerprint = build_fingerprint()
    common = common_hash()
    arches = sorted({s.arch for s in specs})
    manifests = {a: load_manifest(out / a, a, fingerprint) for a in arches}
    outcomes: list[Outcome] = []
    for arch, manifest in manifests.items():
        keep = {s.name for s in specs if s.arch == arch}
        outcomes += [Outcome(n, arch, "pruned") for n in prune_stale(manifest, out / arch, keep)]
    todo: list[tuple[BuildSpec, str]] = []
    for spec in specs:
        fp = variant_fingerprint(spec, fingerprint["cutlass_dsl"], common)
        if not force and is_up_to_date(manifests[spec.arch].variants.get(spec.name), fp, out / spec.arch):
            outcomes.append(Outcome(spec.name, spec.arch, "up-to-date"))
        else:
            todo.append((spec, fp))

    bar = _progress(len(todo), progress)
    # spawn, not fork: each worker imports CuTeDSL fresh; one task per worker keeps CuTeDSL state per variant.
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = {pool.submit(_compile_in_worker, spec): (spec, fp) for spec, fp in todo}
        for fut in cf.as_completed(futures):
            spec, fp = futures[fut]
            try:
                compiled, seconds = fut.result()
                facts = check_compiled(spec, compiled)
                arch_dir = out / spec.arch
                cubin_name = f"{spec.name}.cubin"
                _atomic_write(arch_dir / cubin_name, compiled.cubin)
                if keep_ptx:  # for people reading the code generation; never installed into a wheel
                    _atomic_write(arch_dir / "ptx" / f"{spec.name}.ptx", compiled.ptx.encode())
                manifests[spec.arch].variants[spec.name] = spec.entry(
                    cubin=cubin_name, sha256=hashlib.sha256(compiled.cubin).hexdigest(), fingerprint=fp, **facts)
                _atomic_write(arch_dir / "manifest.json", manifests[spec.arch].dumps().encode())
                outcomes.append(Outcome(spec.name, spec.arch, "built", seconds))
            except Exception as e:  # noqa: BLE001 - reported per variant, the build goes on
                outcomes.append(Outcome(spec.name, spec.arch, "failed", detail=f"{type(e).__name__}: {e}"))
            bar.update(1)
            bar.set_postfix_str(spec.name)
    bar.close()
    for arch, manifest in manifests.items():  # also refreshes the top-level fingerprint when all were current
        _atomic_write(out / arch / "manifest.json", manifest.dumps().encode())
    return outcomes


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a build requirement; this keeps a stripped environment working
        tqdm = None
    if enabled and not sys.stderr.isatty():
        return _Lines(total)  # pip -v and CMake read the build's output by line, where a bar's \r never ends one
    if tqdm is None or not enabled:
        class _Silent:
            def update(self, n): pass
            def set_postfix_str(self, s): pass
            def close(self): pass
        return _Silent()
    return tqdm(total=total, unit="variant", desc="compiling", dynamic_ncols=True)


class _Lines:
    """Progress as one line per finished variant, for output read by line (pip -v, CMake, CI logs)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        print(f"compiling {total} variants (the ones whose fingerprint changed)" if total
              else "nothing to compile: every variant is up to date", file=sys.stderr, flush=True)

    def update(self, n):
        self.done += n

    def set_postfix_str(self, name):
        print(f"  [{self.done}/{self.total}] {name}", file=sys.stderr, flush=True)

    def close(self):
        pass
