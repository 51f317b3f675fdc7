"""Tuning policy of packed sequences on the fixed-length kernels (flash_msa_rt.ops.packed): when sequences of
different lengths share one padded call."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flash_msa_rt.tuning.overrides import Overrides, current, register
from flash_msa_rt.tuning.problem import Problem


@dataclass(frozen=True)
class PackedTuning:
    # What one more call of an op costs, in (query, key) pairs of causal attention per head: a bucket of shorter
    # sequences joins the next longer one when padding its members to that length adds at most this many pairs.
    call_pairs: int
    # The longest padded length a bucket may be merged up to: below it the calls are host-bound (their kernels take
    # less than the call's host time), above it the kernels hide the host time and merging only adds padded work.
    merge_max_length: int
    # Separate query / key offsets (cu_seqlens_k, seqused_k): "kernels" runs each query sequence on the fixed-length
    # kernels against a view of its keys (ops.packed._separate_keys), "reference" the pure-PyTorch reference.
    separate_keys: str
    # Side streams a pack's calls are spread over (ops.packed.SideStreams); 1: all on the current stream.
    streams: int


register("packed", PackedTuning)


def choose(arch: str, problem: Problem = Problem()) -> PackedTuning:
    return _choose(arch, current())


@functools.lru_cache(maxsize=64)
def _choose(arch: str, overrides: Overrides) -> PackedTuning:
    o = overrides.fields("packed")
    # (b), one 64K document + 141 of 128..1024 tokens in 9 calls per op: 93.1 ms fwd + bwd against ~39.8 for the
    # 64K document alone, ~7 ms of it the short documents' own work, so ~5.8 ms per extra bucket; the fixed batch
    # runs ~4e6 causal pairs per ms (16 x 8K: 2.35e8 pairs per head in 58.4 ms), so a call ~2.3e7 pairs. 2**24 stays
    # below it (benchmarks/results/packed_b.json, f23d22c).
    # merge_max_length: merging every bucket under call_pairs also joined the mix's 2.8K-11.6K documents (17 calls
    # -> 5) and took it from 92% to 81% of the fixed batch's TFLOPS (67.9 -> 74.9 ms), while the short documents
    # (all <= 1024) went from 93.1 to 69.3 ms in 2 calls (packed_b.json at f23d22c and 3fa9093). 2048: the top-k
    # window, below which each sequence's attention is dense and its calls small.
    # streams: the 17-document mix, fwd + bwd, 1 / 2 / 4 side streams: (a) 36.9 / 34.8 / 36.6 ms, (b) 70.8 / 65.8 /
    # 65.5, (c) 121.0 / 117.9 / 115.6; the short-document case unchanged (2 calls); outputs and deterministic
    # gradients bitwise equal (H200, e480535 + this policy). 2: the gain in all three. A later run (d51fe1c) had (a)
    # at 40.0 / 42.3 ms with 1 / 2 streams (its host-bound calls vary run to run by more than the gain) while (b)
    # and (c) reached 95 % and 93 % of the fixed batch with 2 (benchmarks/results/packed.json).
    # separate_keys: "kernels": exact against the reference on the CPU (tests/test_kernel_dispatch_cpu.py) and on
    # the H200 (tests/test_packed_gpu.py, tests/test_select_query_offset_gpu.py); the reference is ~100x slower.
    return PackedTuning(call_pairs=int(o.get("call_pairs", 1 << 24)),
                        merge_max_length=int(o.get("merge_max_length", 2048)),
                        separate_keys=o.get("separate_keys", "kernels"),
                        streams=int(o.get("streams", 2)))
