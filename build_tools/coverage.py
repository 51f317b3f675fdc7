"""What the catalogue can build per configuration: the head dims, key blocks and dtypes each family implements on an
arch, and whether a requested configuration gives the MSA op all of its kernels.

A build of a configuration (--head-dim / --block-size / --dtype) that some main MSA family cannot implement would
compile helpers and leave the op on the pure-PyTorch reference, so it is refused here in one paragraph naming the
families and their measured limit (shared memory, registers), with the configurations that do build.
"""

from __future__ import annotations

import importlib
from typing import Sequence

from kernels_src import matrix
from kernels_src.spec import DEFAULT, HOPPER_SYNC_CHECK

# The families one MSA training step launches whatever its options (warmup's dense kernels are optional: warmup runs
# its proxy passes on these sparse families where they are not built).
MAIN_FAMILIES = ("select", "sparse_fwd", "sparse_combine", "sparse_kl", "sparse_combine_kl", "bwd_delta", "sparse_bwd",
                 "sparse_bwd_proxy")
ALL_DTYPES = ("bf16", "f16")


def _family(name: str):
    return importlib.import_module(f"kernels_src.{name}")


def buildable(name: str, arch: str, head_dim: int, block_size: int, dtype: str) -> tuple[bool, str]:
    """(True, "") when family `name` has a variant of the runtime's sets for this configuration on arch, else
    (False, the refusal of its most economical variant: the least shared memory asked, else the first)."""
    fam = _family(name)
    cfgs = fam.configs(head_dims=(head_dim,), block_sizes=(block_size,), dtypes=(dtype,))
    reasons = []
    for c in cfgs:
        ok, reason = fam.can_implement(c, arch)
        if ok and fam.build_set(c, arch) in (DEFAULT, HOPPER_SYNC_CHECK):
            return True, ""
        if not ok:
            reasons.append(reason)
    if not reasons:
        return False, "no variant at this configuration"
    smem = [r for r in reasons if "shared memory" in r]
    return False, min(smem, key=lambda r: int(r.split()[1]) if r.split()[1].isdigit() else 0) if smem else reasons[0]


def served(arch: str, head_dims: Sequence[int], block_sizes: Sequence[int], dtypes: Sequence[str]) -> list[tuple]:
    """(head_dim, block_size, dtype) points of the request whose main families all build on arch."""
    return [(d, bs, dt) for d in head_dims for bs in block_sizes for dt in dtypes
            if all(buildable(n, arch, d, bs, dt)[0] for n in MAIN_FAMILIES)]


def refusal(archs: Sequence[str], head_dims: Sequence[int] | None, block_sizes: Sequence[int] | None,
            dtypes: Sequence[str] | None) -> str | None:
    """None when every requested (head dim, block size, dtype) gives the MSA op all its kernels on every arch, else
    one paragraph: what is missing, why (the measured limit), and what does build."""
    if not (head_dims or block_sizes or dtypes):
        return None
    ds = tuple(head_dims) if head_dims else matrix.DEFAULT_HEAD_DIMS
    bss = tuple(block_sizes) if block_sizes else matrix.DEFAULT_BLOCK_SIZES
    dts = tuple(d for d in (dtypes or ALL_DTYPES) if d in ALL_DTYPES) or tuple(dtypes)
    lines = []
    for arch in archs:
        for d in ds:
            for bs in bss:
                for dt in dts:
                    missing = [(n, r) for n in MAIN_FAMILIES for ok, r in [buildable(n, arch, d, bs, dt)] if not ok]
                    if missing:
                        names = ", ".join(n for n, _ in missing)
                        lines.append(f"D {d}, block size {bs}, {dt} on {arch}: {names} cannot be built "
                                     f"({missing[0][0]}: {missing[0][1]})")
    if not lines:
        return None
    serving = [a for a in archs if not any(line.endswith(f" on {a}") or f" on {a}:" in line for line in lines)]
    if serving:
        return (f"some archs requested cannot run this configuration on kernels, so nothing was built:\n  "
                + "\n  ".join(lines) + f"\nBuild it for {', '.join(serving)} alone: --arch {','.join(serving)}.")
    good = sorted({(d, bs) for arch in archs for d, bs, _ in served(arch, matrix.HEAD_DIMS, matrix.BLOCK_SIZES,
                                                                  ("bf16",))})
    return ("the MSA op would run on the pure-PyTorch reference, so nothing was built:\n  " + "\n  ".join(lines)
            + "\nConfigurations with every kernel: " + ", ".join(f"D {d} / blocks of {bs}" for d, bs in good)
            + f" (dtypes {', '.join(ALL_DTYPES)}; the contract names D in {matrix.HEAD_DIMS}, "
              f"blocks in {matrix.BLOCK_SIZES}).")


def family_table(arch: str) -> list[str]:
    """One line per family: the head dims, block sizes and dtypes it implements on arch (any variant)."""
    from kernels_src.catalogue import FAMILIES

    out = []
    for mod in FAMILIES:
        name = mod.rsplit(".", 1)[-1]
        fam = _family(name)
        dims, sizes, dtypes = set(), set(), set()
        cfgs = fam.configs(head_dims=matrix.HEAD_DIMS, block_sizes=matrix.BLOCK_SIZES, dtypes=None)
        for c in cfgs:
            if fam.can_implement(c, arch)[0]:
                dims.add(getattr(c, "head_dim", None))
                sizes.add(getattr(c, "block_size", None))
                dtypes.add(getattr(c, "dtype", None))

        def text(values):
            vals = sorted(v for v in values if v is not None)
            return ",".join(map(str, vals)) if vals else "-"
        out.append(f"{name:<18} head dims {text(dims):<12} block sizes {text(sizes):<10} dtypes {text(dtypes)}")
    return out


# --- the supported matrix (README.md, docs/matrix.md) ------------------------------------------------------------

# The families each public op launches on the kernels; an op runs on the pure-PyTorch reference at a configuration
# where one of them cannot be built. Selection ranks with a proxy of Dp = min(D, 128) (the contract's widest proxy).
MATRIX_OPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("selection", ("select",)),
    ("MSA forward", ("plan_lists", "sparse_fwd", "sparse_combine", "sparse_kl", "sparse_combine_kl")),
    ("backward", ("bwd_delta", "sparse_bwd", "sparse_bwd_proxy", "grad_cast")),
    ("warmup", ("warmup_kl", "warmup_bwd_proxy")),
    ("block-sparse", ("plan_lists", "sparse_fwd", "sparse_combine", "bwd_delta", "sparse_bwd", "grad_cast")),
)
MATRIX_ARCHS = ("sm90a", "sm100a")
MATRIX_BEGIN = "<!-- supported matrix: generated by `python -m build_tools matrix --write`; do not edit -->"
MATRIX_END = "<!-- end of the supported matrix -->"


def op_backend(op: str, arch: str, head_dim: int, block_size: int, dtype: str = "bf16") -> str:
    """"kernels" when every family `op` launches builds at this configuration on arch, else "reference"."""
    families = dict(MATRIX_OPS)[op]
    # A configuration some main family cannot build is refused by the build and declined by the runtime
    # (flash_msa_rt.ops.kernels.UNREACHABLE_HEAD_DIMS): only the selection, which runs at Dp, stays on kernels.
    if op != "selection" and not all(buildable(n, arch, head_dim, block_size, dtype)[0] for n in MAIN_FAMILIES):
        return "reference"

    def ok(names) -> bool:
        return all(buildable(n, arch, min(head_dim, 128) if n == "select" else head_dim, block_size, dtype)[0]
                   for n in names)
    if ok(families):
        return "kernels"
    # warmup's proxy passes run on the sparse MSA families where its dense ones are not built
    if op == "warmup" and ok(dict(MATRIX_OPS)["MSA forward"] + dict(MATRIX_OPS)["backward"]):
        return "kernels"
    return "reference"


def matrix_table() -> str:
    """The supported matrix as markdown: configuration (D x Bs) x op x arch, "kernels" or "reference", from the
    catalogue (what each family's can_implement accepts), and whether the default wheel carries the configuration.
    Each op's cell holds its backend on each arch of MATRIX_ARCHS in order, "/" between them."""
    archs = " / ".join(MATRIX_ARCHS)
    rows = ["| D | Bs | in the wheel | " + " | ".join(f"{op} ({archs})" for op, _ in MATRIX_OPS) + " |",
            "|---|---|---|" + "---|" * len(MATRIX_OPS)]
    for d in matrix.HEAD_DIMS:
        for bs in matrix.BLOCK_SIZES:
            default = d in matrix.DEFAULT_HEAD_DIMS and bs in matrix.DEFAULT_BLOCK_SIZES
            serving = [arch for arch in MATRIX_ARCHS
                       if all(buildable(n, arch, d, bs, "bf16")[0] for n in MAIN_FAMILIES)]
            only = "" if len(serving) == len(MATRIX_ARCHS) else f"--arch {','.join(serving)} "
            wheel = ("yes" if default else
                     f"no; build `{only}--head-dim {d} --block-size {bs}`" if serving else
                     "no; refused by the build")
            if serving and only:
                wheel += f" ({', '.join(a for a in MATRIX_ARCHS if a not in serving)}: refused)"
            cells = [" / ".join(op_backend(op, arch, d, bs) for arch in MATRIX_ARCHS) for op, _ in MATRIX_OPS]
            rows.append(f"| {d} | {bs} | {wheel} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def matrix_section() -> str:
    """The text between (and including) the markers, as README.md and docs/matrix.md hold it."""
    return f"{MATRIX_BEGIN}\n{matrix_table()}{MATRIX_END}"


def splice_matrix(text: str) -> str:
    """text with its marked section replaced by the current matrix (ValueError without the markers)."""
    start, end = text.find(MATRIX_BEGIN), text.find(MATRIX_END)
    if start < 0 or end < start:
        raise ValueError("no supported-matrix markers")
    return text[:start] + matrix_section() + text[end + len(MATRIX_END):]


MATRIX_FILES = ("README.md", "docs/matrix.md")
