"""Errors the runtime raises. Each message names the thing at fault, its value, and what would work."""


class FlashMsaError(Exception):
    """Base of the runtime's own errors."""


class NoGPUError(FlashMsaError, RuntimeError):
    """No CUDA device is visible, or a tensor is not on one."""


class UnsupportedArchError(FlashMsaError, NotImplementedError):
    """The device's compute capability has no build in this package."""


class MissingVariantError(FlashMsaError, NotImplementedError):
    """The config asked for was not compiled into the artifacts found."""


class ArtifactError(FlashMsaError, RuntimeError):
    """An artifact is missing, corrupt, or was built by another toolchain or from other sources."""


class LaunchError(FlashMsaError, RuntimeError):
    """A CUDA driver call failed while loading or launching a kernel."""
