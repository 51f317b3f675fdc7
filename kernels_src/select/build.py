"""select's build entry: the kernel class a config picks, compiled as block_scores' score-tile kernels are."""

from kernels_src.block_scores.build import compile_score_tiles
from kernels_src.select import Config, params
from kernels_src.spec import Compiled


def compile(config: Config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    if config.schedule == "pairs":
        from kernels_src.select.wgmma import ProxySelectWGPairs as Kernel
    elif config.schedule == "wide":
        from kernels_src.select.wgmma import ProxySelectWGWide as Kernel
    elif config.mma == "wgmma":
        from kernels_src.select.wgmma import ProxySelectWG as Kernel
    else:
        from kernels_src.select.kernel import ProxySelect as Kernel
    return compile_score_tiles(Kernel(config), config, arch, params(config), "block_indices", extra=("k_scale",))
