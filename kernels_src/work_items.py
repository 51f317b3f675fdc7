"""Decoding the plan's work items (flash_msa_rt.ops.sparse_plan) in the kernels that run one per CTA.

items[w] = (b * Hp + p, key block j, first entry, entries): key block j of batch b and proxy head p, and the
entries (queries) that selected it, from entry_query[first] on. Trace-time helpers: they emit the loads and the
integer math where they are called.
"""


def item_block(items, w, hp, block_size: int):
    """Work item w's batch b, proxy head p, first entry and the first key of its block."""
    bp, j, start = items[w, 0], items[w, 1], items[w, 2]
    b = bp // hp
    return b, bp - b * hp, start, j * block_size


def item_slice(items, w, cta, halves: int, hp, block_size: int, tile_n: int):
    """For the kernels that cut a key block into `halves` slices of tile_n keys, one CTA each (CTA cta runs slice
    cta - w * halves of item w = cta // halves): b, p, first entry and the slice's first key t0."""
    bp, j, start = items[w, 0], items[w, 1], items[w, 2]
    b = bp // hp
    p = bp - b * hp
    t0 = j * block_size + (cta - w * halves) * tile_n
    return b, p, start, t0


def keys_in_query_rows(t0, queries, keys):
    """(Sk, q_t0): the keys' length and key position t0 in query rows. Keys may outnumber queries (a chunk against
    its whole prefix): query row i sits at key position i + Sk - S, so a causal mask compares rows with
    q_t0 = t0 - (Sk - S)."""
    seqlen = keys.shape[1]
    return seqlen, t0 - (seqlen - queries.shape[1])
