"""sparse_bwd_proxy's build entry: the kernel class a config picks (how the G main heads are visited, MMA) and
its entry point."""

from kernels_src.compile import compile_declared
from kernels_src.sparse_bwd_proxy import params, smem_bytes
from kernels_src.spec import Compiled


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    entry = None
    if config.heads == "tau":
        from kernels_src.sparse_bwd_proxy.tau import SparseProxyBackwardTau

        kernel = SparseProxyBackwardTau(config)
        det, kl = getattr(config, "deterministic", 0), getattr(config, "kl_value", 0)
        entry = {(0, 0): None, (1, 0): kernel.call_det, (0, 1): kernel.call_kl, (1, 1): kernel.call_det_kl}[det, kl]
    elif config.heads == "resident":
        from kernels_src.sparse_bwd_proxy.resident import SparseProxyBackwardResident

        kernel = SparseProxyBackwardResident(config)
    elif config.mma == "wgmma":
        from kernels_src.sparse_bwd_proxy.wgmma import SparseProxyBackwardWG

        kernel = SparseProxyBackwardWG(config)
    else:
        from kernels_src.sparse_bwd_proxy.kernel import SparseProxyBackward

        kernel = SparseProxyBackward(config)
    return compile_declared(kernel, config, arch, params(config), smem_bytes(config), entry=entry)
