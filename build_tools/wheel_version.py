"""scikit-build-core metadata plugin: the wheel's version names the GPU archs it carries (0.1.0+sm90a)."""

from __future__ import annotations

import os
import re
from pathlib import Path

DEFAULT_ARCHS = "sm90a;sm100a"  # CMakeLists.txt holds the same default


def archs_from_env() -> list[str]:
    raw = os.environ.get("FLASH_MSA_ARCHS", DEFAULT_ARCHS)
    return [a for a in re.split(r"[;,\s]+", raw) if a]


def dynamic_metadata(field, settings=None, project=None):
    if field != "version":
        raise RuntimeError(f"wheel_version provides only the version, not {field!r}")
    init = Path(__file__).resolve().parent.parent / "flash_msa_rt" / "__init__.py"
    base = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.M).group(1)
    return f"{base}+{'.'.join(archs_from_env())}"
