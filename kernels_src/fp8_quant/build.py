"""fp8_quant's build entry."""

from cutlass.cute.runtime import make_fake_stream

from kernels_src.compile import compile_kernel, fake_tensor
from kernels_src.fp8_quant import params, smem_bytes
from kernels_src.fp8_quant.kernel import QuantizeKeyBlocks, QuantizeRows
from kernels_src.spec import Compiled


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    kernel = (QuantizeRows if config.block_size == 1 else QuantizeKeyBlocks)(config)
    fake = (*(fake_tensor(p) for p in params(config)), make_fake_stream())
    compiled = compile_kernel(kernel, config, arch, fake)
    if compiled.smem_bytes != smem_bytes(config):
        raise RuntimeError(f"shared memory: kernel {compiled.smem_bytes} bytes, spec {smem_bytes(config)}")
    return compiled
