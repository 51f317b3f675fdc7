"""MSA proxy KL pass: each entry's share of its row's KL (msa-semantics.md, "Proxy KL loss").

Runs after the forward pass and its combine, over the same work items (flash_msa_rt.ops.sparse_plan), with the
final lse of every main head and of the proxy: per (entry, head g), sum over the block's causal keys t of
P_g(t) (log tau(t) - log pi(t)) / G. The runtime sums the K slots and G heads of a row into kl_rows. Same kernel
class and configs as sparse_fwd (kernels_src.sparse_fwd.kernel), without V. This module does not import cutlass.
"""

from __future__ import annotations


from flash_msa_rt.manifest import TensorParam
from kernels_src import sparse_fwd
from kernels_src.spec import BuildSpec, family_spec

OP = "sparse_kl"

Config = sparse_fwd.Config
configs = sparse_fwd.configs


def can_implement(config, arch: str) -> tuple[bool, str]:
    return sparse_fwd.can_implement(config, arch, with_v=False)


def params(config) -> tuple:
    """The kernel param ABI, in PTX .param order."""
    o = sparse_fwd.operands(config)
    g = config.group
    lse = TensorParam("lse", "f32", ("B", "H", "S"), ("i64", "i64", 1), align=4)
    lse_proxy = TensorParam("lse_proxy", "f32", ("B", "Hp", "S"), ("i64", "i64", 1), align=4)
    kl_part = TensorParam("kl_part", "f32", ("E", g), (g, 1), align=4)
    return (o["q"], o["k"], o["q_proxy"], o["k_proxy"], o["entry_query"], o["entry_dest"], o["items"],
            lse, lse_proxy, kl_part, *sparse_fwd.scalars())


def build_spec(config, arch: str) -> BuildSpec:
    return family_spec(OP, config, arch, can_implement, params=params(config),
                       grid=("W", "1", "1"),
                       compile_fn="kernels_src.sparse_fwd.kernel:compile_kl",
                       smem_bytes=config.smem_bytes(with_v=False))
