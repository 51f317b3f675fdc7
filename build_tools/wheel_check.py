"""What a wheel may carry under flash_msa_rt/_artifacts/: per arch, manifest.json and exactly the cubins it lists,
each an ELF cubin for that arch's SM with the sha256 the manifest records. No PTX: the wheels ship SASS only
(PTX would make the driver JIT-compile at load time, and the runtime never compiles).

    python -m build_tools.wheel_check dist/*.whl     # exit 1 listing every problem
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import zipfile
from pathlib import Path, PurePosixPath

ARTIFACTS = PurePosixPath("flash_msa_rt/_artifacts")
EM_CUDA = 190
# The SM number the ELF header carries for each arch's cubins (sm_100a and sm_100f both say 100).
ARCH_SM = {"sm90a": 90, "sm100a": 100, "sm100f": 100}


def cubin_sm(data: bytes) -> int | None:
    """The SM number in a cubin's ELF header, or None when it is not a CUDA ELF. CUDA 12.8+ writes ELF ABI
    version 8, with the SM in e_flags bits 8-15; older toolchains put it in bits 0-7."""
    if data[:4] != b"\x7fELF" or len(data) < 52:
        return None
    is64 = data[4] == 2
    e_machine = struct.unpack_from("<H", data, 18)[0]
    if e_machine != EM_CUDA:
        return None
    e_flags = struct.unpack_from("<I", data, 48 if is64 else 36)[0]
    return (e_flags >> 8) & 0xFF if data[8] >= 8 else e_flags & 0xFF


def check_files(files: dict[str, bytes]) -> list[str]:
    """Problems in {path inside the wheel: bytes} for the artifact tree; [] when it is clean."""
    problems = []
    by_arch: dict[str, dict[str, bytes]] = {}
    for name, data in files.items():
        path = PurePosixPath(name)
        if path.suffix == ".ptx":
            problems.append(f"{name}: PTX is shipped; the wheels carry cubins only")
        try:
            rel = path.relative_to(ARTIFACTS)
        except ValueError:
            continue
        if len(rel.parts) != 2:
            problems.append(f"{name}: not <arch>/<file> under {ARTIFACTS}")
            continue
        by_arch.setdefault(rel.parts[0], {})[rel.parts[1]] = data
    for arch, arch_files in sorted(by_arch.items()):
        if arch not in ARCH_SM:
            problems.append(f"{ARTIFACTS / arch}: unknown arch folder (known: {', '.join(ARCH_SM)})")
            continue
        raw = arch_files.pop("manifest.json", None)
        if raw is None:
            problems.append(f"{ARTIFACTS / arch}: no manifest.json")
            continue
        manifest = json.loads(raw)
        if manifest.get("arch") != arch:
            problems.append(f"{ARTIFACTS / arch}/manifest.json: describes arch {manifest.get('arch')!r}")
        listed = {}
        for vname, v in manifest.get("variants", {}).items():
            listed[v["cubin"]] = v
            if v.get("arch") != arch or not vname.endswith(f"_{arch}"):
                problems.append(f"{ARTIFACTS / arch}: variant {vname} is for arch {v.get('arch')!r}")
        for fname in sorted(set(arch_files) - set(listed)):
            problems.append(f"{ARTIFACTS / arch / fname}: not listed in the manifest")
        for fname, v in sorted(listed.items()):
            data = arch_files.get(fname)
            where = ARTIFACTS / arch / fname
            if data is None:
                problems.append(f"{where}: listed in the manifest but missing")
                continue
            sm = cubin_sm(data)
            if sm != ARCH_SM[arch]:
                problems.append(f"{where}: cubin for SM {sm} in the {arch} folder (SM {ARCH_SM[arch]})")
            if hashlib.sha256(data).hexdigest() != v["sha256"]:
                problems.append(f"{where}: sha256 differs from the manifest's")
    return problems


def wheel_files(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}


def tree_files(root: Path) -> dict[str, bytes]:
    """An artifact root (<root>/<arch>/...) as the paths a wheel would hold."""
    return {str(ARTIFACTS / p.relative_to(root).as_posix()): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def main(argv=None) -> int:
    paths = [Path(a) for a in (argv if argv is not None else sys.argv[1:])]
    problems = []
    for p in paths:
        if not p.exists():
            problems.append(f"{p}: does not exist")
            continue
        files = wheel_files(p) if p.suffix == ".whl" else tree_files(p)
        problems += [f"{p.name}: {x}" for x in check_files(files)]
    for x in problems:
        print(x, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
