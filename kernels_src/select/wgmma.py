"""MSA selection on Hopper's warpgroup MMA (wgmma, sm90a only): the mma.sync kernel's CTA, TMA pipeline, row
ownership and heaps, with each key block's scores from one warpgroup's products (kernels_src.block_scores.wgmma:
the score tiles, shared with block_scores). Two CTAs per SM (shared memory unchanged, 109 KB at max_k 16) let
one CTA's row maxima and heap inserts run under the other's products.
"""

from __future__ import annotations

from kernels_src.block_scores.wgmma import WarpgroupScores
from kernels_src.select.kernel import ProxySelect


class ProxySelectWG(WarpgroupScores, ProxySelect):
    pass
