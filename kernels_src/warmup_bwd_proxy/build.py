"""warmup_bwd_proxy's build entry: one kernel class, compiled on the declared ABI."""

from kernels_src.compile import compile_declared
from kernels_src.spec import Compiled
from kernels_src.warmup_bwd_proxy import params
from kernels_src.warmup_bwd_proxy.kernel import WarmupProxyBackward


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    return compile_declared(WarmupProxyBackward(config), config, arch, params(config), config.smem_bytes())
