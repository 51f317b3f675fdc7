"""sparse_kl's build entry: the kernel class a config picks (MMA, schedule, resident or streamed heads)."""

from kernels_src.compile import compile_declared
from kernels_src.sparse_kl import params, resident_heads, smem_bytes
from kernels_src.spec import Compiled


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    if not config.kl_value:
        from kernels_src.sparse_kl.lse import SparseProxyLse as Kernel
    elif config.schedule == "pingpong" and resident_heads(config):
        from kernels_src.sparse_kl.pingpong import SparseKLPingPong as Kernel
    elif config.schedule == "pingpong":
        from kernels_src.sparse_kl.streamed import SparseKLStreamed as Kernel
    elif config.mma == "wgmma":
        from kernels_src.sparse_kl.wgmma import SparseKLWG as Kernel
    else:
        from kernels_src.sparse_kl.kernel import SparseKL as Kernel
    return compile_declared(Kernel(config), config, arch, params(config), smem_bytes(config))
