"""Named barrier ids (bar.sync / bar.arrive) of the kernels that synchronise fewer threads than the CTA.

Id 0 is the CTA barrier (cute.arch.sync_threads); ids are per kernel, 1 to 15. An id "+ warpgroup" is one barrier
per warpgroup: id + 0 for warpgroup 0, id + 1 for warpgroup 1.
"""


class SparseFwdPingPong:
    """kernels_src/sparse_fwd/pingpong.py."""

    ROWS = 1  # + warpgroup: its own gathered q rows are in shared memory (its 128 threads)
    TURN = 3  # + warpgroup: its turn to issue the QK product (256 threads: 128 waiting, 128 arriving)


class SparseKLPingPong:
    """kernels_src/sparse_kl/pingpong.py and streamed.py."""

    ROWS = 1  # + warpgroup: its 128 threads' gathered rows are in shared memory


class WarmupKLPingPong:
    """kernels_src/warmup_kl/pingpong.py."""

    QUERIES = 1  # the consumers' barrier: the resident query tiles are loaded
    TURN = 2  # + warpgroup: its turn to issue a step's first product


class SparseBackward:
    """kernels_src/sparse_bwd: with a producer warpgroup (producer.py) the consumers meet here, not at the CTA
    barrier."""

    CONSUMERS = 1
