"""flash-msa runtime: ahead-of-time compiled MSA kernels, loaded through cuda-python and bound to torch.

Importing this package never imports cutlass or compiles anything, and imports torch only when an op is
first touched (the build stage reads flash_msa_rt.manifest in an environment without torch); kernels load
lazily on first use.
"""

from flash_msa_rt.errors import (ArtifactError, FlashMsaError, LaunchError, MissingVariantError, NoGPUError,
                                 UnsupportedArchError)

__version__ = "0.1.0"

# Public ops, imported on first access: name -> module.
_OPS = {
    "proxy_block_scores": "flash_msa_rt.ops.block_scores",
    **{name: "flash_msa_rt.api" for name in (
        "flash_msa_func", "flash_msa_warmup_func", "flash_msa_func_warmup", "flash_msa_varlen_func",
        "flash_msa_warmup_varlen_func", "block_sparse_attention", "select_blocks")},
}

__all__ = [
    *_OPS,
    "FlashMsaError",
    "ArtifactError",
    "LaunchError",
    "MissingVariantError",
    "NoGPUError",
    "UnsupportedArchError",
    "__version__",
]


def __getattr__(name):
    if name in _OPS:
        import importlib

        _notice_missing_kernels()
        value = getattr(importlib.import_module(_OPS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flash_msa_rt' has no attribute {name!r}")


_noticed = False


def _notice_missing_kernels() -> None:
    """Once, when the first op is imported: with the runtime alone installed on a GPU machine, name the per-arch
    package the GPU needs (here rather than at package import, which the build stage's workers also run)."""
    global _noticed
    if not _noticed:
        _noticed = True
        from flash_msa_rt.artifacts import import_notice

        notice = import_notice()
        if notice:
            import warnings

            warnings.warn(notice, stacklevel=3)
