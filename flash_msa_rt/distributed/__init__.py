"""Context parallelism: one sequence sharded over the ranks of a torch.distributed process group, computed exactly
as the single-process op on the full sequence (docs/msa-semantics.md, "Context parallelism"; design and
communication volumes in docs/context-parallel.md).

    shard_sequence(x, group, seq_dim=..., scheme="zigzag")      this rank's part of a full tensor
    unshard_sequence(x_local, group, seq_dim=..., scheme=...)    the full tensor on every rank (differentiable)
    flash_msa_cp_func(...), flash_msa_warmup_cp_func(...)        MSA / warmup over this rank's shards
"""

from flash_msa_rt.distributed.attention import flash_msa_cp_func, flash_msa_warmup_cp_func
from flash_msa_rt.distributed.sharding import SCHEMES, shard_spans, shard_sequence, unshard_sequence

__all__ = ["flash_msa_cp_func", "flash_msa_warmup_cp_func", "shard_sequence", "unshard_sequence", "shard_spans",
           "SCHEMES"]
