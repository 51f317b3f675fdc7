"""MSA KL pass on Hopper's warpgroup MMA (wgmma, sm90a only): the mma.sync kernel's tiles, heads loop and (A, T, L)
shares, with the score products S_g = Q_g K^T and S_p = Q_p K_p^T issued by warpgroups
(kernels_src.sparse_bwd.wgmma.WarpgroupTiles, shared with both backward kernels).

Each tile is 64 distinct queries x this CTA's 64 keys: warpgroup w computes the queries against keys
[32 w, 32 w + 32) with wgmma m64n32k16, so a thread holds 2 query rows x 8 keys of its warpgroup's 32 and a key
group of the KL shares is still one warpgroup's keys (kl_part columns: group = 2 * key slice + tidx // 128).
"""

from kernels_src.sparse_bwd.wgmma import WarpgroupTiles
from kernels_src.sparse_kl.kernel import SparseKL


class SparseKLWG(WarpgroupTiles, SparseKL):
    def __init__(self, config):
        super().__init__(config)
        self._check_wg_tiles("sparse_kl")
