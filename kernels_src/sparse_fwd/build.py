"""sparse_fwd's build entry: the kernel class a config picks (MMA, schedule), compiled on its declared ABI."""

from kernels_src.compile import compile_declared
from kernels_src.sparse_fwd import params
from kernels_src.spec import Compiled


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    if config.mma == "wgmma" and config.schedule == "pingpong":
        from kernels_src.sparse_fwd.pingpong import SparseAttentionPingPong as Kernel
    elif config.mma == "wgmma":
        from kernels_src.sparse_fwd.wgmma import SparseAttentionWG as Kernel
    else:
        from kernels_src.sparse_fwd.kernel import SparseAttention as Kernel
    kernel = Kernel(config)
    return compile_declared(kernel, config, arch, params(config), config.smem_bytes(), entry=kernel.forward)
