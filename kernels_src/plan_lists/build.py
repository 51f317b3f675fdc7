"""plan_lists' build entries: the list kernels (one entry per phase) and the item kernel."""

import cutlass
from cutlass.cute.runtime import make_fake_stream

from kernels_src.compile import compile_kernel, fake_tensor
from kernels_src.plan_lists import item_params, params
from kernels_src.spec import Compiled


def compile(config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    from kernels_src.plan_lists.kernel import PlanLists

    kernel = PlanLists(config)
    ps = params(config)
    fake = (*(fake_tensor(p) for p in ps if p.kind == "tensor"), cutlass.Int32(1), cutlass.Int32(1),
            cutlass.Int32(1), make_fake_stream())
    return compile_kernel(kernel, config, arch, fake, entry=getattr(kernel, config.phase))


def compile_items(config, arch: str) -> Compiled:
    from kernels_src.plan_lists.items import PlanItems

    kernel = PlanItems(config)
    fake = (*(fake_tensor(p) for p in item_params(config) if p.kind == "tensor"),
            *(cutlass.Int32(1) for p in item_params(config) if p.kind == "scalar"), make_fake_stream())
    return compile_kernel(kernel, config, arch, fake)
