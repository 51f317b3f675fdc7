"""flash-msa runtime: ahead-of-time compiled MSA kernels, loaded through cuda-python and bound to torch.

Importing this package never imports cutlass or compiles anything; kernels load lazily on first use.
"""

from flash_msa_rt.errors import (ArtifactError, FlashMsaError, LaunchError, MissingVariantError, NoGPUError,
                                 UnsupportedArchError)
from flash_msa_rt.ops.block_scores import proxy_block_scores

__version__ = "0.1.0"

__all__ = [
    "proxy_block_scores",
    "FlashMsaError",
    "ArtifactError",
    "LaunchError",
    "MissingVariantError",
    "NoGPUError",
    "UnsupportedArchError",
    "__version__",
]
