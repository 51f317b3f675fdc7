"""python -m flash_msa_rt info: version, archs and variants carried, the device, and whether they match."""

from __future__ import annotations

import argparse
import sys

from flash_msa_rt import __version__, artifacts
from flash_msa_rt.errors import FlashMsaError


def info() -> int:
    root = artifacts.artifact_root()
    print(f"flash-msa runtime {__version__}")
    print(f"artifacts: {root}" + (f" (from ${artifacts.ENV_ARTIFACT_DIR})" if artifacts.ENV_ARTIFACT_DIR in
                                   __import__('os').environ else " (inside the package)"))
    archs = artifacts.carried_archs(root)
    if not archs:
        print("  no artifacts found: build them with `python -m build_tools build --arch sm90a` "
              f"and set {artifacts.ENV_ARTIFACT_DIR}")
    for arch in archs:
        try:
            m = artifacts.load_manifest(root, arch)
        except FlashMsaError as e:
            print(f"  {arch}: unusable: {e}")
            continue
        print(f"  {arch}: {len(m.variants)} variants, built with nvidia-cutlass-dsl {m.fingerprint.get('cutlass_dsl')}")
        for name, v in sorted(m.variants.items()):
            print(f"    {name:<58} regs {v.registers:>3}  smem {v.smem_bytes:>6} B")
    status = 0
    try:
        import torch
        if not torch.cuda.is_available():
            print("device: none visible (torch.cuda.is_available() is False)")
        else:
            from flash_msa_rt.loader import device_arch
            i = torch.cuda.current_device()
            cap = torch.cuda.get_device_capability(i)
            print(f"device: {torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}")
            arch = device_arch(i)
            match = arch in archs
            print(f"  needs {arch}: {'carried' if match else 'NOT carried'}")
            status = 0 if match else 1
    except FlashMsaError as e:
        print(f"  {e}")
        status = 1
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flash_msa_rt")
    p.add_argument("verb", choices=["info"], help="info: what this installation carries and whether it fits the GPU")
    p.parse_args(argv)
    return info()


if __name__ == "__main__":
    sys.exit(main())
