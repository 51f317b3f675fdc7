"""sparse_combine's build entry."""

import cutlass
from cutlass.cute.runtime import make_fake_stream

from kernels_src.compile import compile_kernel, fake_tensor
from kernels_src.sparse_combine import params
from kernels_src.sparse_combine.kernel import SparseCombine
from kernels_src.spec import Compiled


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    kernel = SparseCombine(config)
    fake = (*(fake_tensor(p) for p in params(config) if p.kind == "tensor"), cutlass.Int32(0), make_fake_stream())
    return compile_kernel(kernel, config, arch, fake, entry=kernel.call_sinks if config.scale_rows else None)
