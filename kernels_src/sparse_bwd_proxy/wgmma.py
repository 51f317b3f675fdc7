"""The proxy backward on Hopper's warpgroup MMA (wgmma, sm90a only): the mma.sync kernel's tiles (64 distinct queries
x this CTA's 64 keys, heads visited in turn), dS_p, staging and reductions, with its four products (S_g, S_p,
dq_p = dS_p K_p, dk_p += dS_p^T Q_p) issued by warpgroups through kernels_src.sparse_bwd.wgmma.WarpgroupTiles.
"""

from kernels_src.sparse_bwd.wgmma import WarpgroupTiles
from kernels_src.sparse_bwd_proxy.kernel import SparseProxyBackward


class SparseProxyBackwardWG(WarpgroupTiles, SparseProxyBackward):
    # Row copies: 4 threads per row ((c) 64K, G = 16: 25.8 -> 20.6 ms against 16; the resident subclass keeps 16).
    ROW_THREADS = 4

    def __init__(self, config):
        super().__init__(config)
        self._check_wg_tiles("sparse_bwd_proxy")
