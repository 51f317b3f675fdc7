"""python -m flash_msa_rt {info, selftest}: what this installation carries, and whether its kernels work on this GPU.

Exit codes, one table for both verbs (Exit below; docs/building.md, "Checking an installation"): 0 ok, 2 usage,
3 no GPU, 4 no artifacts for this GPU (the message names the package to install), 5 a self-test failure.
A reader that closes the pipe early (`info --verbose | head`) ends the command quietly, exit 1, no traceback.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
from collections import Counter
from pathlib import Path

from flash_msa_rt import __version__, artifacts, guard
from flash_msa_rt import arch as arches
from flash_msa_rt.errors import FlashMsaError, NoGPUError


class Exit(enum.IntEnum):
    OK = 0
    USAGE = 2  # argparse's own code for a bad command line
    NO_GPU = 3
    NO_ARTIFACTS = 4  # none for this GPU's arch (or none at all): names the package to install
    SELFTEST_FAILED = 5

    def describe(self) -> str:
        return {0: "ok", 2: "usage error", 3: "no GPU", 4: "no artifacts for this GPU",
                5: "a self-test check failed"}[int(self)]


SELFTEST_HINT = "check the kernels on this GPU: python -m flash_msa_rt selftest --quick (or without --quick: all)"


def source_checkout() -> Path | None:
    """The source checkout this flash_msa_rt was imported from, or None for an installed package."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "kernels_src").is_dir() else None


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 variant', '2 variants', '1 kernel family', '3 kernel families'."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {plural or (noun[:-1] + 'ies' if noun.endswith('y') else noun + 's')}"


def install_hint(arch: str) -> str:
    return f"install the {arch} build: {arches.install_hint(arch)}"


def describe_artifacts(verbose: bool) -> list[str]:
    """Print what the artifact root holds, per arch and per kernel family; returns the usable archs."""
    root = artifacts.artifact_root()
    from_env = artifacts.ENV_ARTIFACT_DIR in os.environ
    print(f"artifacts: {root}" + (f" (from ${artifacts.ENV_ARTIFACT_DIR})" if from_env else " (inside the package)"))
    checkout = source_checkout()
    if checkout is not None:
        print(f"  note: flash_msa_rt was imported from the source checkout {checkout} (the current directory or "
              f"PYTHONPATH puts it ahead of any installed package), so this reports the checkout, not the installed "
              f"package; run `cd ~ && python -m flash_msa_rt info` to check the installed one")
    usable = []
    archs = artifacts.carried_archs(root)
    if not archs:
        dists = ", ".join(arches.arch_dist(a) for a in arches.RUNS_ON)
        print(f"  no artifacts found there: install the package of your GPU's arch ({dists}), or build them from a "
              f"checkout with `python -m build_tools build --arch sm90a` and set {artifacts.ENV_ARTIFACT_DIR}")
    for arch in archs:
        try:
            m = artifacts.load_manifest(root, arch)
        except FlashMsaError as e:
            print(f"  {arch}: unusable: {e}")
            continue
        usable.append(arch)
        families = Counter(v.op for v in m.variants.values())
        print(f"  {arch}: {count(len(m.variants), 'variant')} in {count(len(families), 'kernel family')}, built with "
              f"nvidia-cutlass-dsl {m.fingerprint.get('cutlass_dsl')}")
        if guard.unverified(arch):
            print(f"    not verified on {arch} hardware: each kernel family checks itself against the reference on "
                  f"first use ({guard.ENV_MODE}=warn|raise|off; docs/guard.md)")
        for op, n in sorted(families.items()):
            print(f"    {op:<24} {n:>4} {'variant' if n == 1 else 'variants'}")
        if verbose:
            for name, v in sorted(m.variants.items()):
                print(f"      {name:<58} regs {v.registers:>3}  smem {v.smem_bytes:>6} B")
    if archs and not verbose:
        print("  (--verbose lists every variant)")
    return usable


def device_status(usable: list[str]) -> Exit:
    """Print the device and whether the artifacts serve it; the exit code per the table."""
    try:
        import torch
    except ImportError:
        print("device: torch is not installed, so no GPU can be used")
        return Exit.NO_GPU
    if not torch.cuda.is_available():
        print("device: none visible (torch.cuda.is_available() is False); the public API runs the pure-PyTorch "
              "reference on CPU tensors")
        return Exit.NO_GPU
    i = torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(i)
    name = torch.cuda.get_device_name(i)
    print(f"device: {name}, compute capability {cap[0]}.{cap[1]}")
    try:
        candidates = arches.arch_candidates(cap[0], cap[1], name)
    except FlashMsaError as e:
        print(f"  {e}")
        return Exit.NO_ARTIFACTS
    arch = next((a for a in candidates if a in usable), None)
    if arch is None:
        print(f"  needs {' or '.join(candidates)}: NOT carried here; {install_hint(candidates[0])}")
        return Exit.NO_ARTIFACTS
    print(f"  needs {' or '.join(candidates)}: {arch} carried")
    print(f"  {SELFTEST_HINT}")
    return Exit.OK


def info(verbose: bool = False) -> int:
    print(f"flash-msa runtime {__version__}")
    usable = describe_artifacts(verbose)
    status = device_status(usable)
    if status != Exit.OK:
        print(f"exit {int(status)}: {status.describe()}")
    return int(status)


def selftest(quick: bool, json_path: str | None) -> int:
    from flash_msa_rt import selftest as st

    print(f"flash-msa runtime {__version__} self-test ({'quick' if quick else 'full'})")
    checkout = source_checkout()
    if checkout is not None:
        print(f"note: testing the source checkout {checkout}, not an installed package")
    try:
        name, arch = st.device_arch()
    except NoGPUError as e:
        print(f"no GPU: {e}", file=sys.stderr)
        return Exit.NO_GPU
    except FlashMsaError as e:  # a GPU no flash-msa arch serves
        print(f"{e}", file=sys.stderr)
        return Exit.NO_ARTIFACTS
    if arch not in usable_archs():
        print(f"no {arch} artifacts under {artifacts.artifact_root()} for {name}; {install_hint(arch)}",
              file=sys.stderr)
        return Exit.NO_ARTIFACTS
    print(f"device: {name} ({arch}); artifacts: {artifacts.artifact_root()}")
    print(st.HEADER)
    report = st.run(quick=quick, echo=print)
    print(st.summary(report))
    if json_path:
        st.write_json(report, json_path)
        print(f"wrote {json_path}")
    return Exit.SELFTEST_FAILED if report.failed else Exit.OK


def usable_archs() -> list[str]:
    """The archs whose manifest loads (no output)."""
    root = artifacts.artifact_root()
    usable = []
    for arch in artifacts.carried_archs(root):
        try:
            artifacts.load_manifest(root, arch)
        except FlashMsaError:
            continue
        usable.append(arch)
    return usable


def parser() -> argparse.ArgumentParser:
    codes = "; ".join(f"{int(c)} {c.describe()}" for c in Exit)
    p = argparse.ArgumentParser(prog="python -m flash_msa_rt", epilog=f"exit codes: {codes}")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="{info,selftest}")
    i = verbs.add_parser("info", help="what this installation carries (per kernel family) and whether it fits the GPU")
    i.add_argument("--verbose", "-v", action="store_true", help="list every variant")
    s = verbs.add_parser("selftest", help="run every kernel family on this GPU against the reference")
    s.add_argument("--quick", action="store_true", help="one problem per family (under 30 s on an H200)")
    s.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)  # exits 2 (Exit.USAGE) on a bad command line
    if args.verb == "info":
        return info(args.verbose)
    return int(selftest(args.quick, args.json))


def run(argv=None) -> int:
    """main(), and a closed output pipe (`info --verbose | head`) ends it quietly instead of in a traceback."""
    try:
        code = main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python would report the failed flush of stdout at exit too: point stdout at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(run())
