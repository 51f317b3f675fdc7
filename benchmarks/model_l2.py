"""A model, not a measurement: the main sparse backward's DRAM traffic per item order, from its plan on the CPU.

The plan's items (sparse_plan.chunk_plans, the backward's cut) run on `slots` CTA slots, each taking the next item
when it frees (an item costs a prologue of `prologue` tiles plus its tiles, all tiles the same time). In that time
order every tile touches, per query of the tile: its gathered q and dO rows (2 G D bytes each, read) and its fp32
dq rows (4 G D bytes, read and later written back: a reduction needs the line in the L2); every item first reads its
key block (2 Bs D bytes each of K and V). An LRU cache of `l2_mb` MB stands in for the L2. It prints the bytes the
model reads from and writes to DRAM for each order, to compare with Nsight Compute's figure for the list order
(kernels_src/sparse_bwd/NOTES.md: 67 GB at (b) 64K, B = 2) before trusting its prediction for another.

    python benchmarks/model_l2.py [--cfg b] [--seqlen 65536] [--orders list,query,bins:4096,bins:8192] [--l2-mb 50]

--forward models sparse_fwd instead: per tile query its gathered q rows (2 G D bytes, read) and per entry its
partial rows (2 G D + 4 G bytes, written whole: allocated in the cache, written back on eviction, never read), on
its tiles of 128 rows; the combine's read of the partials is the same in every order and not counted.

The selection is random: top-K distinct blocks of each query's causal prefix, its own block always among them
(what the benchmarks' random inputs select).
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import CONFIGS  # noqa: E402
from benchmarks.common import commit  # noqa: E402


def random_selection(B: int, Hp: int, S: int, K: int, Bs: int, seed: int = 0) -> torch.Tensor:
    """(B, Hp, S, K) int32: K distinct blocks of each query's causal prefix (fewer where the prefix is shorter:
    -1), its own block first."""
    g = torch.Generator().manual_seed(seed)
    NB = -(-S // Bs)
    own = (torch.arange(S) // Bs).view(1, 1, S, 1)
    score = torch.rand(B, Hp, S, NB, generator=g)
    blocks = torch.arange(NB).view(1, 1, 1, NB)
    score = torch.where(blocks > own, -1.0, torch.where(blocks == own, 2.0, score))
    top = score.topk(min(K, NB), dim=-1)
    return torch.where(top.values >= 0, top.indices, -1).to(torch.int32)


def tile_events(plan, slots: int, prologue: float):
    """(time, item, tile) of every tile, and each item's start, in time order on `slots` CTA slots."""
    items = plan.items[:int(plan.item_count)].tolist()
    free = [(0.0, s) for s in range(slots)]
    events, starts = [], []
    for w, (_, _, _, n) in enumerate(items):
        t, s = heapq.heappop(free)
        starts.append((t, w))
        tiles = -(-n // plan.tile_queries)
        events.extend((t + prologue + k, w, k) for k in range(tiles))
        heapq.heappush(free, (t + prologue + tiles, s))
    events.extend((t, w, -1) for t, w in starts)  # the key block's load, at the item's start
    events.sort()
    return items, events


def dram_bytes(plan, G: int, D: int, Bs: int, l2_bytes: int, slots: int, prologue: float,
               forward: bool = False) -> dict:
    """Bytes the LRU model reads and writes back, by kind. forward: sparse_fwd's traffic instead (q rows read,
    each entry's partial rows written once, no dq)."""
    items, events = tile_events(plan, slots, prologue)
    query = plan.entry_query.tolist()
    tq = plan.tile_queries
    rows, dq, kv = 4 * G * D, 4 * G * D, 4 * Bs * D  # q + dO rows (bf16), dq rows (fp32), K + V block (bf16)
    if forward:  # q rows (bf16); the entry's partial rows, G D in bf16 plus G fp32 lse, written
        rows, part = 2 * G * D, 2 * G * D + 4 * G
    cache: collections.OrderedDict = collections.OrderedDict()
    used = 0
    read = collections.Counter()
    written = 0

    def touch(key, size, kind):
        nonlocal used, written
        if key in cache:
            cache.move_to_end(key)
            return
        read[kind] += size
        cache[key] = size
        used += size
        while used > l2_bytes:
            old, old_size = cache.popitem(last=False)
            used -= old_size
            if old[0] in ("dq", "part"):
                written += old_size

    for _, w, k in events:
        bp, j, start, n = items[w]
        if k < 0:
            touch(("kv", bp, j), kv, "key blocks")
            continue
        for e in range(start + k * tq, start + min(n, (k + 1) * tq)):
            if forward:
                touch(("rows", bp, query[e]), rows, "q rows")
                touch(("part", e), part, "partials (allocated)")
                continue
            touch(("rows", bp, query[e]), rows, "q, dO rows")
            touch(("dq", bp, query[e]), dq, "dq rows")
    written += sum(size for key, size in cache.items() if key[0] in ("dq", "part"))  # the final write-back
    if forward:  # a partial's lines are written whole: never read from DRAM
        read.pop("partials (allocated)", None)
    return dict(read_gb={kind: v / 1e9 for kind, v in read.items()}, dq_written_gb=written / 1e9,
                total_gb=(sum(read.values()) + written) / 1e9, items=len(items))


def main(argv=None):
    from flash_msa_rt.ops.block_split import split_blocks
    from flash_msa_rt.ops.sparse_plan import chunk_plans
    from flash_msa_rt.tuning.sparse_bwd import TILE_M

    FORWARD_TILE_ROWS = 128  # kernels_src.sparse_fwd: two warpgroups x 64 rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cfg", default="b", choices=sorted(CONFIGS))
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--tiles-per-item", type=int, default=64)
    ap.add_argument("--forward", action="store_true",
                    help="sparse_fwd's traffic (q rows read, partial rows written) on its tiles of 128 rows")
    ap.add_argument("--orders", default="list,query,bins:4096,bins:8192")
    ap.add_argument("--halves", action="store_true",
                    help="select blocks of 2 Bs and run their halves (D 256's kernels on blocks of 128)")
    ap.add_argument("--l2-mb", type=float, default=50.0)
    ap.add_argument("--slots", type=int, default=132, help="CTAs resident at once (one per SM)")
    ap.add_argument("--prologue", type=float, default=2.0, help="an item's set-up, in tiles")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    H, Hk, Hp, Hpk = CONFIGS[a.cfg]
    G, Bs, D = H // Hp, a.block_size, a.head_dim
    if a.halves:
        sel = split_blocks(random_selection(a.batch, Hp, a.seqlen, a.top_k // (2 * Bs), 2 * Bs), 2, Bs, a.seqlen)
    else:
        sel = random_selection(a.batch, Hp, a.seqlen, a.top_k // Bs, Bs)
    result = dict(model="benchmarks/model_l2.py (an LRU model of the L2, not a measurement)", commit=commit(),
                  command="python benchmarks/model_l2.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  cfg=a.cfg,
                  seqlen=a.seqlen, batch=a.batch, head_dim=D, block_size=Bs, halves=a.halves, l2_mb=a.l2_mb,
                  slots=a.slots,
                  orders={})
    print(f"({a.cfg}) S = {a.seqlen}, B = {a.batch}, D = {D}, Bs = {Bs}, G = {G}; LRU of {a.l2_mb:g} MB, "
          f"{a.slots} CTA slots")
    for spec in a.orders.split(","):
        order, _, q = spec.partition(":")
        tile_rows = FORWARD_TILE_ROWS if a.forward else TILE_M
        (plan,), = chunk_plans(sel, Bs, G, Hp, a.seqlen, ((tile_rows // G, a.tiles_per_item),), order,
                               bin_queries=int(q or 2048)).values()
        r = dram_bytes(plan, G, D, Bs, int(a.l2_mb * 1e6), a.slots, a.prologue, a.forward)
        result["orders"][spec] = r
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["read_gb"].items())
        print(f"  {spec:>10}: {r['items']} items; DRAM {r['total_gb']:.1f} GB (read: {parts}; "
              f"{'partials' if a.forward else 'dq'} written back {r['dq_written_gb']:.1f})", flush=True)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
