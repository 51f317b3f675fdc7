"""block_scores' build entry, and the compile of every kernel on the proxy score tiles (block_scores, select):
fake arguments of the declared ABI, then CuTeDSL's traced TMA descriptors checked against the declared ones."""

from cutlass.cute.runtime import make_fake_stream

from kernels_src.block_scores import Config, params
from kernels_src.compile import check_traced, compile_kernel, fake_params, fake_tensor
from kernels_src.spec import Compiled


def fake_args(declared: tuple, output: str, extra: tuple[str, ...] = ()):
    """Fake q_proxy, k_proxy, the output tensor (by its declared name) and the extra tensors named (None where
    the declaration has none: the kernel's optional tensor arguments) built from the declared tensor params, then
    the declared scalars in order and a stream, so the compile sees exactly the runtime's ABI.

    Strides are plain i64: the kernel never does address math with the q/k strides (TMA does), and
    cuTensorMapEncodeTiled itself rejects strides that are not 16-byte multiples.
    """
    decl = {p.name: p for p in declared}
    tensors = [fake_tensor(decl[name]) for name in ("q_proxy", "k_proxy", output)]
    tensors += [fake_tensor(decl[name]) if name in decl else None for name in extra]
    scalars = fake_params([p for p in declared if p.kind == "scalar"])[:-1]  # [:-1]: its stream
    return (*tensors, *scalars, make_fake_stream())


def compile_score_tiles(kernel, config, arch: str, declared: tuple, output: str,
                        extra: tuple[str, ...] = ()) -> Compiled:
    compiled = compile_kernel(kernel, config, arch, fake_args(declared, output, extra))
    check_traced(config, kernel.traced, declared)
    return compiled


def compile(config: Config, arch: str) -> Compiled:  # noqa: A001 - the build_tools entry point name
    if config.mma == "wgmma":
        from kernels_src.block_scores.wgmma import ProxyBlockScoresWG as Kernel
    else:
        from kernels_src.block_scores.kernel import ProxyBlockScores as Kernel
    return compile_score_tiles(Kernel(config), config, arch, params(config), "scores")
