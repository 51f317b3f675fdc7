"""python -m build_tools {build,list,matrix}: compile the kernel catalogue ahead of time (no GPU needed).

  python -m build_tools build --arch sm90a,sm100a [--set SETS] [--only PATTERN] [--head-dim 64,128]
                              [--block-size 64,128] [--dtype bf16,f16] [--out DIR] [-j N]
  python -m build_tools list  --arch sm90a [--set all] [--only PATTERN] [--out DIR]
  python -m build_tools matrix [--write]   # the supported matrix (D x Bs x op x arch) as markdown; --write puts it
                                           # into README.md and docs/matrix.md between their markers

One command per configuration: `python -m build_tools build --arch sm90a --head-dim 64 --block-size 64` compiles
every kernel the MSA op needs at D 64 with key blocks of 64 into artifacts/ (the runtime finds it there, or where
FLASH_MSA_ARTIFACT_DIR points; `pip install .` takes the same choices from FLASH_MSA_HEAD_DIMS / FLASH_MSA_BLOCK_SIZES).
Without --head-dim / --block-size a build compiles the default matrix (kernels_src/matrix.py: D 64 and 128, blocks
of 128). A configuration that some main MSA kernel cannot implement is refused with the measured limit;
`list` prints what each family implements.

Build sets (kernels_src.spec): "default" (what the runtime's default paths launch), "hopper_sync_check" (on sm90a,
the mma.sync variants of the sm100a paths), "opt_in" (alternates kept for A/B runs), "all". A build compiles
default,hopper_sync_check unless --set or FLASH_MSA_BUILD_SET says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from build_tools.build import REPO, BuildError, build, build_fingerprint, common_hash, is_up_to_date, load_manifest
from build_tools.build import variant_fingerprint
from build_tools import coverage
from kernels_src.catalogue import CatalogueError, parse_sets, variants
from kernels_src import matrix
from kernels_src.spec import ARCHS, DEFAULT_ARCHS, DEFAULT_SETS

DEFAULT_OUT = REPO / "artifacts"
BUILD_SET_ENV = "FLASH_MSA_BUILD_SET"  # the wheel build (CMakeLists.txt) passes its environment through


def _csv(kind):
    def parse(text: str):
        items = [t for t in text.replace(";", ",").split(",") if t]
        try:
            return [kind(t) for t in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return parse


def _join(values) -> str:
    return ",".join(str(v) for v in values)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m build_tools", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    for verb in ("build", "list"):
        s = sub.add_parser(verb)
        s.add_argument("--arch", type=_csv(str), default=list(DEFAULT_ARCHS),
                       help=f"comma-separated archs of {','.join(ARCHS)} (default: {','.join(DEFAULT_ARCHS)})")
        s.add_argument("--set", dest="sets", default=os.environ.get(BUILD_SET_ENV) or ",".join(DEFAULT_SETS),
                       help=f"comma-separated build sets, or all (default: ${BUILD_SET_ENV}, else "
                            f"{','.join(DEFAULT_SETS)})")
        s.add_argument("--only", action="append", default=None, metavar="PATTERN",
                       help="glob over variant names; repeatable (default: all)")
        s.add_argument("--head-dim", type=_csv(int), default=None,
                       help=f"head dims D, any of {_join(matrix.HEAD_DIMS)} (default: "
                            f"{_join(matrix.DEFAULT_HEAD_DIMS)}); the proxy's Dp of {_join(matrix.PROXY_HEAD_DIMS)} "
                            f"up to D come with them")
        s.add_argument("--block-size", type=_csv(int), default=None,
                       help=f"key block sizes Bs, any of {_join(matrix.BLOCK_SIZES)} (default: "
                            f"{_join(matrix.DEFAULT_BLOCK_SIZES)})")
        s.add_argument("--dtype", type=_csv(str), default=None,
                       help="dtypes of q, k, v: bf16, f16 (default: both; the fp8 selection's e4m3 variants come with "
                            "them); `list` prints what each family implements")
        s.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"artifact root (default: {DEFAULT_OUT})")
        s.add_argument("--into-installed", action="store_true",
                       help="build into the installed flash-msa-rt's own artifacts (pip-installed runtime picks them "
                            "up with no environment variable); overrides --out")
    m = sub.add_parser("matrix", help="the supported matrix: which op runs on kernels at which D, Bs and arch")
    m.add_argument("--write", action="store_true", help="update README.md and docs/matrix.md between the markers")
    b = sub.choices["build"]
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    b.add_argument("--force", action="store_true", help="rebuild even when the fingerprint is unchanged")
    b.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    return p


def _select(args):
    return variants(args.arch, sets=parse_sets(args.sets), only=args.only, head_dims=args.head_dim,
                    block_sizes=args.block_size, dtypes=args.dtype)


def cmd_list(args) -> int:
    for arch in args.arch:
        print(f"what each family implements on {arch} (any variant):")
        for line in coverage.family_table(arch):
            print(f"  {line}")
    why = coverage.refusal(args.arch, args.head_dim, args.block_size, args.dtype)
    if why:
        print(f"note: {why}")
    specs = _select(args)
    fp = build_fingerprint()
    common = common_hash()
    manifests = {a: load_manifest(args.out / a, a, fp) for a in args.arch}
    for s in specs:
        entry = manifests[s.arch].variants.get(s.name)
        state = ("up-to-date" if is_up_to_date(entry, variant_fingerprint(s, fp["cutlass_dsl"], common),
                                               args.out / s.arch)
                 else "stale" if entry else "not built")
        print(f"{s.name:<72} {s.build_set:<18} {state}")
    counts = ", ".join(f"{sum(s.build_set == n for s in specs)} {n}" for n in sorted({s.build_set for s in specs}))
    print(f"{len(specs)} variants ({counts}); artifacts in {args.out}")
    return 0


def cmd_build(args) -> int:
    why = coverage.refusal(args.arch, args.head_dim, args.block_size, args.dtype)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    specs = _select(args)
    if not specs:
        print("no variant matches the selection; `python -m build_tools list --set all` shows the whole catalogue",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    outcomes = build(specs, args.out, jobs=args.jobs, force=args.force, progress=not args.no_progress)
    wall = time.perf_counter() - t0
    failed = [o for o in outcomes if o.status == "failed"]
    for o in sorted(outcomes, key=lambda o: o.name):
        extra = f"{o.seconds:6.1f} s" if o.status == "built" else ""
        print(f"{o.status:<10} {o.name:<60} {extra}")
        if o.detail:
            print(f"           {o.detail}")
    count = {status: sum(o.status == status for o in outcomes) for status in ("built", "up-to-date", "pruned")}
    pruned = (f", {count['pruned']} pruned (compiled from kernel sources since changed, and not in this build)"
              if count["pruned"] else "")
    print(f"{count['built']} built, {count['up-to-date']} up to date, {len(failed)} failed{pruned} "
          f"in {wall:.1f} s wall ({args.jobs} jobs); artifacts in {args.out}")
    return 1 if failed else 0


def installed_artifacts() -> Path:
    """The artifact folder inside the pip-installed flash-msa-rt (not this checkout's flash_msa_rt, which a run from
    the checkout imports first)."""
    import importlib.metadata as md

    try:
        dist = md.distribution("flash-msa-rt")
    except md.PackageNotFoundError as e:
        raise BuildError("--into-installed: flash-msa-rt is not pip-installed in this environment; build into "
                         "--out DIR and point FLASH_MSA_ARTIFACT_DIR at it instead") from e
    return Path(dist.locate_file("flash_msa_rt")).resolve() / "_artifacts"


def cmd_matrix(args) -> int:
    if not args.write:
        print(coverage.matrix_table(), end="")
        return 0
    for rel in coverage.MATRIX_FILES:
        path = REPO / rel
        new = coverage.splice_matrix(path.read_text())
        if new != path.read_text():
            path.write_text(new)
            print(f"updated {rel}")
        else:
            print(f"{rel} is up to date")
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.verb == "matrix":
        return cmd_matrix(args)
    for a in args.arch:
        if a not in ARCHS:
            print(f"error: --arch {a!r} is not supported; supported: {', '.join(ARCHS)}", file=sys.stderr)
            return 2
    try:
        if args.into_installed:
            args.out = installed_artifacts()
        return {"build": cmd_build, "list": cmd_list}[args.verb](args)
    except (CatalogueError, BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
