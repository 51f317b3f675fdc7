"""warmup_kl's build entry: the kernel class a config's schedule picks."""

from kernels_src.compile import compile_declared
from kernels_src.spec import Compiled
from kernels_src.warmup_kl import params


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    if not config.kl_value:
        from kernels_src.warmup_kl.lse import WarmupProxyLse as Kernel
    elif config.schedule == "pingpong":
        from kernels_src.warmup_kl.pingpong import WarmupKLPingPong as Kernel
    else:
        from kernels_src.warmup_kl.kernel import WarmupKL as Kernel
    return compile_declared(Kernel(config), config, arch, params(config), config.smem_bytes())
