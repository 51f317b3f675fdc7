"""bwd_delta's build entry."""

from cutlass.cute.runtime import make_fake_stream

from kernels_src.bwd_delta import params
from kernels_src.bwd_delta.kernel import BackwardDelta
from kernels_src.compile import compile_kernel, fake_tensor
from kernels_src.spec import Compiled


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    kernel = BackwardDelta(config)
    fake = (*(fake_tensor(p) for p in params(config)), make_fake_stream())
    return compile_kernel(kernel, config, arch, fake, entry=kernel.call_scaled if config.scale_rows else None)
