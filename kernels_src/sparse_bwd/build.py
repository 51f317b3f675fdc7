"""sparse_bwd's build entry: the kernel class a config picks (MMA, producer warpgroup) and its entry point
(plain, tau_out, deterministic)."""

from kernels_src.compile import compile_declared
from kernels_src.sparse_bwd import PRODUCER_THREADS, params
from kernels_src.spec import Compiled


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    if config.mma == "wgmma" and config.threads == PRODUCER_THREADS:
        from kernels_src.sparse_bwd.producer import SparseBackwardWS as Kernel
    elif config.mma == "wgmma":
        from kernels_src.sparse_bwd.wgmma import SparseBackwardWG as Kernel
    else:
        from kernels_src.sparse_bwd.kernel import SparseBackward as Kernel
    kernel = Kernel(config)
    entry = kernel.call_det if getattr(config, "deterministic", 0) else \
        kernel.call_tau if getattr(config, "tau_out", 0) else None
    return compile_declared(kernel, config, arch, params(config), config.smem_bytes(), entry=entry)
