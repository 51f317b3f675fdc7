"""The PEP 517 build backend: scikit-build-core, plus CuTeDSL as a build requirement only when the wheel
compiles kernels (build_tools/wheel_archs.py decides which). A machine without a GPU that builds the runtime
alone then downloads neither nvidia-cutlass-dsl nor its CUDA 13 libraries.
"""

from __future__ import annotations

from pathlib import Path

from scikit_build_core import build as _skbuild
from scikit_build_core.build import *  # noqa: F401,F403 - every hook we do not wrap

from build_tools import wheel_archs

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def kernel_build_requires(project_dir: Path | None = None) -> list[str]:
    """[tool.flash-msa] kernel-build-requires: the exact compiler (the manifest records its version and the
    runtime refuses artifacts of another) and the progress bar."""
    path = Path(project_dir or Path.cwd()) / "pyproject.toml"
    return list(tomllib.loads(path.read_text())["tool"]["flash-msa"]["kernel-build-requires"])


def _extra() -> list[str]:
    try:
        archs, _ = wheel_archs.resolve()
    except wheel_archs.ArchChoiceError as e:
        raise SystemExit(f"error: {e}") from None
    return kernel_build_requires() if archs else []


def get_requires_for_build_wheel(config_settings=None):
    return [*_skbuild.get_requires_for_build_wheel(config_settings), *_extra()]


def get_requires_for_build_editable(config_settings=None):
    return [*_skbuild.get_requires_for_build_editable(config_settings), *_extra()]
