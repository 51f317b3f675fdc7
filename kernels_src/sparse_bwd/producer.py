"""The main sparse backward warp-specialised (sm90a, wgmma on the whole key block, tau_out = 1): a producer
warpgroup gathers every tile's rows, so the two warpgroups that compute never issue a gather.

Without it (kernel.py) all 256 threads gather tile t + 1's q / dO rows and row scalars at the top of tile t: per
thread 8 rows' entry lookups, address math and cp.asyncs, ~15 % of the kernel's warp samples at the tile top, and
the tile's first CTA barrier waits for the slowest thread's gather issue (NOTES.md). Here:
  - warpgroup 2 (threads 256..383) is the producer: it cp.asyncs tile t's rows and lse / delta words into stage
    t % 2 and arrives on full[stage] when its copies land (cp.async.mbarrier.arrive.noinc; 128 arrivals); before
    refilling a stage it waits on empty[stage], where each of the 256 consumer threads arrives once the tile's last
    products (dV reads dO, dK reads Q) are done;
  - the consumers (threads 0..255) load the key block, wait on full[stage] instead of a cp.async group and a CTA
    barrier, and meet at a named barrier of 256 threads (kernel.consumers_sync) where the kernel had sync_threads.
Everything else (products, exponentials, tau, dq reductions, the key block's atomics) is kernel.py's.
Why a warpgroup and not one warp: an SM sub-partition holds 16K registers and takes every fourth warp, so a ninth
warp caps every thread at 168 registers (ptxas spilled 464 bytes at 288 threads). With setmaxnreg the producer
warpgroup gives its registers up (PRODUCER_REGS) and the consumers take CONSUMER_REGS: 2 x 32 x 232 + 32 x 40 =
16128 of 16384 per sub-partition. The tau kernels at G <= 4 use 219-224 registers without a producer, at G >= 8
246-250, so the variant exists at G <= 4 only.
"""

import dataclasses

from kernels_src.constants import WARPGROUP_THREADS
from kernels_src.sparse_bwd.wgmma import SparseBackwardWG

CONSUMERS = 2 * WARPGROUP_THREADS
PRODUCERS = WARPGROUP_THREADS


class SparseBackwardWS(SparseBackwardWG):
    CONSUMER_REGS = 232
    PRODUCER_REGS = 40

    def __init__(self, config):
        if (config.threads != CONSUMERS + PRODUCERS or not getattr(config, "tau_out", 0)
                or getattr(config, "deterministic", 0)):
            raise ValueError(f"{type(self).__name__}: threads {config.threads}, tau_out "
                             f"{getattr(config, 'tau_out', 0)}, deterministic {getattr(config, 'deterministic', 0)}; "
                             f"{CONSUMERS} consumers + a producer warpgroup with tau_out 1, deterministic 0 only")
        super().__init__(dataclasses.replace(config, threads=CONSUMERS))
        self.cfg = config
        self.ws = True
        self.block_threads = config.threads
