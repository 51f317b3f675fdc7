"""Stage a wheel's artifacts: from the persistent build cache, exactly the variants this build selected.

    python -m build_tools.wheel_stage --cache CACHE --stage STAGE  <the `build_tools build` arguments>

CMakeLists.txt compiles into a cache that outlives the wheel build (.kernel-cache in the source tree by
default: `build_tools build` skips every variant whose fingerprint is unchanged, so a second `pip install .`
compiles nothing), then calls this to copy the selection (manifest.json restricted to it, and its cubins; no
PTX) into STAGE/<arch>/, which CMake installs as flash_msa_rt/_artifacts/. The cache may hold more variants
(other selections, earlier builds); the wheel carries only the ones asked for, and build_tools.wheel_check
verifies them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from build_tools.__main__ import _select, parser
from build_tools.wheel_check import check_files, tree_files
from flash_msa_rt.manifest import Manifest


class StageError(RuntimeError):
    pass


def stage(build_argv: list[str], cache: Path, out: Path) -> dict[str, int]:
    """Copy the selection of `build_tools build <build_argv>` from cache to out; returns variants per arch."""
    args = parser().parse_args(["build", *build_argv])
    specs = _select(args)
    if out.exists():
        shutil.rmtree(out)  # a previous build's archs or variants must not leak into this wheel
    counts = {}
    for arch in args.arch:
        names = sorted(s.name for s in specs if s.arch == arch)
        cached = Manifest.load(cache / arch / "manifest.json")
        missing = [n for n in names if n not in cached.variants]
        if missing:
            raise StageError(f"{len(missing)} selected variants are not in {cache / arch} (did the build fail?): "
                             f"{', '.join(missing[:5])}")
        picked = Manifest(arch=arch, fingerprint=dict(cached.fingerprint),
                          variants={n: cached.variants[n] for n in names},
                          hardware_verified=cached.hardware_verified)
        (out / arch).mkdir(parents=True)
        for entry in picked.variants.values():
            shutil.copyfile(cache / arch / entry.cubin, out / arch / entry.cubin)
        (out / arch / "manifest.json").write_text(picked.dumps())
        counts[arch] = len(names)
    problems = check_files(tree_files(out))
    if problems:
        raise StageError("the staged artifacts are not fit to ship:\n  " + "\n  ".join(problems))
    return counts


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cache = Path(argv[argv.index("--cache") + 1])
        out = Path(argv[argv.index("--stage") + 1])
    except (ValueError, IndexError):
        print("usage: python -m build_tools.wheel_stage --cache DIR --stage DIR <build_tools build arguments>",
              file=sys.stderr)
        return 2
    for flag in ("--cache", "--stage"):
        i = argv.index(flag)
        del argv[i:i + 2]
    try:
        counts = stage(argv, cache, out)
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"flash-msa: the wheel carries {', '.join(f'{n} {a} variants' for a, n in counts.items())} (from {cache})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
