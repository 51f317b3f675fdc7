"""Work plan and combine of the KV-outer MSA sparse forward (msa-semantics.md, "Main sparse attention", "Proxy KL").

Why KV-outer. Each query i of proxy group p chose K key blocks, shared by the G = H / Hp main heads of the group.
Query-outer tiles would hold only G rows per query (mostly padding for the 64-row wgmma), so the kernel turns the
selection around: a work item is ONE key block j of one (b, p) plus the queries that chose it, packed as tiles of
tq queries x G heads = 128 rows (tile row r is query r // G, head r % G). The CTA loads block j's keys once and
streams up to T such tiles against them. Each (query, slot) then holds a partial result of one block; the combine
merges a query's K partials with their log-sum-exps (the flash-decoding split-KV merge; flash_msa_rt.ops.partials).

Why bounded items. The reverse lists are skewed: the first blocks of a sequence (an attention sink) are chosen by
almost every later query, most blocks by few. One item per block would serialise the whole sequence's queries of
block 0 on one CTA. Cutting every list into chunks of at most T * tq queries bounds an item's work, so a hot block
spreads over many CTAs; the price is one more item per list (the ceil), which the bound W accounts for.

Sorting. On CUDA tensors chunk_plans sorts with the plan kernels (kernels_src/plan_lists: a counting sort whose
ranks come from per-tile bitmaps, then the cut into items): three launches and ~8 torch ops per plan, where the
torch path below (one stable radix sort and ~35 ops) cost the host ~15 us per op. The torch path stays the CPU
path, the fallback (very long S, K > 64) and the statement the kernels are tested against, field for field.

Everything here is shape-static and never synchronises the host with the device: sizes come from shapes only
(W is an upper bound; items past the real count have n_entries = 0), the lists come from one stable sort and
searchsorted (no nonzero, no boolean indexing, no data-sized bincount), so the plan can be captured in a CUDA
graph and traced under FakeTensorMode.

Live entries. An entry (b, p, i, slot) is live when its block j satisfies 0 <= j <= blk(i) = i // Bs: -1 slots are
empty, and a later block holds no causal key of query i, so it contributes nothing (msa-semantics: allowed keys
are t <= i; with keys longer than queries, query row i sits at key position key_offset + i and blk(i) is that
position's block). Only live entries enter items, so a kernel tile never sees an all-masked row or an out-of-range
block, and every live entry has at least one causal key (t = j * Bs <= i). The combines (flash_msa_rt.ops.partials)
mask the rest with the same predicate (torch.where, never boolean indexing): their partial rows are never written and
hold garbage.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch

from flash_msa_rt.tuning import plan as tuning_plan

_INT32_LIMIT = 2 ** 31


@dataclasses.dataclass(frozen=True)
class SparsePlan:
    """Sorted reverse lists and bounded work items of one sparse forward.

    entry_query int32 [E]: query i of each entry, entries sorted by (b * Hp + p, j, i), dead entries last.
    entry_dest int32 [E]: flat index ((b * Hp + p) * S + i) * K + slot of each sorted entry: the row of the
        partial buffers (o_part, lse_part, lsep_part, kl_part) that the kernel writes for it.
    items int32 [W, 4]: (bp, j, entry_start, n_entries), list-major (bp, then j, then chunk); n_entries <=
        tiles_per_item * tile_queries; rows past the real count have n_entries = 0 and (0, 0, 0, 0).
    item_count int32 [1]: the real number of items, on the device (a persistent scheduler may read it).
    list_bounds int64 [L + 1]: list l = bp * NB + j holds sorted entries [list_bounds[l], list_bounds[l + 1])
        (recut cuts the same sorted lists into other items).
    """

    entry_query: torch.Tensor
    entry_dest: torch.Tensor
    items: torch.Tensor
    item_count: torch.Tensor
    list_bounds: torch.Tensor
    E: int
    W: int
    K: int
    Hp: int
    S: int
    B: int
    NB: int
    block_size: int
    group: int
    tile_queries: int
    tiles_per_item: int
    query_offset: int = 0
    # Keys longer than queries (Sk = key_offset + the queries' S): row i of the queries sits at key position
    # key_offset + i, which the live rule and NB use; entry_query stays a query row.
    key_offset: int = 0

    @property
    def entries_per_item(self) -> int:
        return self.tiles_per_item * self.tile_queries


def _positive_int(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{fn}: {name} = {value} must be positive")
    return value


def live_slots(block_indices: torch.Tensor, block_size: int, query_offset: int = 0) -> torch.Tensor:
    """bool (B, Hp, S, K): slot holds a block j with 0 <= j <= blk(i), i.e. a block with causal keys for i.
    Row r of block_indices is query i = query_offset + r (a chunk of a longer sequence)."""
    S = block_indices.shape[2]
    i = torch.arange(query_offset, query_offset + S, device=block_indices.device, dtype=torch.int32)
    local = (i // block_size).view(1, 1, S, 1)
    return (block_indices >= 0) & (block_indices <= local)


def sparse_plan(block_indices: torch.Tensor, block_size: int, seqlen: int, group: int, tile_queries: int,
                tiles_per_item: int, query_offset: int = 0, key_offset: int = 0) -> SparsePlan:
    """The KV-outer work plan of block_indices (B, Hp, S, K) int32 (-1 = empty; entries of a row distinct).

    group = G = H / Hp, tile_queries = tq queries per 128-row tile (128 // G in the kernel), tiles_per_item = T.
    Entries of a list (bp, j) are consecutive in entry_query / entry_dest and sorted by query; each list is cut
    into items of at most T * tq entries. W = ceil(E / (T * tq)) + B * Hp * NB bounds the item count:
    sum over lists of ceil(n_l / C) <= sum (n_l / C + 1) <= E / C + lists.
    query_offset: block_indices holds the rows of queries [query_offset, query_offset + seqlen) of a longer
    sequence (the forward plans a chunk of queries at a time to bound its partial buffers): entry_query is
    absolute, entry_dest indexes the chunk's (B, Hp, seqlen, K) grid.
    key_offset: the keys are longer than the queries by key_offset (query row i at key position key_offset + i,
    bottom-right causal alignment): the live rule and the key blocks NB count in key positions.
    """
    fn = "sparse_plan"
    if not isinstance(block_indices, torch.Tensor):
        raise TypeError(f"{fn}: block_indices must be a torch.Tensor, got {type(block_indices).__name__}")
    if block_indices.dtype != torch.int32 or block_indices.dim() != 4:
        raise ValueError(f"{fn}: block_indices must be int32 (B, Hp, S, K), got {block_indices.dtype} "
                         f"{tuple(block_indices.shape)}")
    Bs = _positive_int(fn, "block_size", block_size)
    S = _positive_int(fn, "seqlen", seqlen)
    G = _positive_int(fn, "group", group)
    tq = _positive_int(fn, "tile_queries", tile_queries)
    T = _positive_int(fn, "tiles_per_item", tiles_per_item)
    B, Hp, S_idx, K = block_indices.shape
    if S_idx != S:
        raise ValueError(f"{fn}: block_indices has {S_idx} query rows (dim 2) but seqlen = {S}")
    if B * Hp * K == 0:
        raise ValueError(f"{fn}: block_indices {tuple(block_indices.shape)} is empty (B, Hp and K must be positive)")
    E = B * Hp * S * K
    if E * G >= _INT32_LIMIT:
        raise ValueError(f"{fn}: block_indices {tuple(block_indices.shape)} with group = {G} gives E * G = {E * G} "
                         f"partial rows, past int32 (< 2**31): split the batch or the sequence")
    if isinstance(query_offset, bool) or not isinstance(query_offset, int) or query_offset < 0:
        raise ValueError(f"{fn}: query_offset must be a non-negative int, got {query_offset!r}")
    if isinstance(key_offset, bool) or not isinstance(key_offset, int) or key_offset < 0:
        raise ValueError(f"{fn}: key_offset must be a non-negative int, got {key_offset!r}")
    entry_query, entry_dest, bounds, NB = _sorted_lists(block_indices, Bs, query_offset, key_offset)
    items, item_count, W = _cut_items(bounds, NB, E, tq * T)
    return SparsePlan(entry_query=entry_query, entry_dest=entry_dest, items=items, item_count=item_count,
                      list_bounds=bounds, E=E, W=W, K=K, Hp=Hp, S=S, B=B, NB=NB, block_size=Bs, group=G,
                      tile_queries=tq, tiles_per_item=T, query_offset=query_offset, key_offset=key_offset)


def _sorted_lists(block_indices: torch.Tensor, Bs: int, query_offset: int, key_offset: int = 0):
    """(entry_query, entry_dest, list_bounds, NB) of sparse_plan: the entries sorted by list, and the lists'
    bounds."""
    B, Hp, S, K = block_indices.shape
    NB = -(-(key_offset + query_offset + S) // Bs)
    L = B * Hp * NB  # lists, one per (bp, j)
    dev = block_indices.device

    # List id bp * NB + j of each entry in (bp, i, slot) order; dead entries go to the spare list L (sorted last).
    live = live_slots(block_indices, Bs, key_offset + query_offset)
    bp = torch.arange(B * Hp, device=dev, dtype=torch.int32).view(B, Hp, 1, 1)
    list_id = torch.where(live, bp * NB + block_indices, torch.full((), L, dtype=torch.int32, device=dev))
    # A stable sort on the list id keeps the (i, slot) order inside each list: sorted by query, since a row's
    # blocks are distinct (one entry per query per list). int32 keys: fewer radix passes than (list, i) int64 keys.
    sorted_list, order = torch.sort(list_id.reshape(-1), stable=True)
    entry_dest = order.to(torch.int32)  # E < 2**31 (sparse_plan checks): the decode runs in int32
    entry_query = torch.div(entry_dest, K, rounding_mode="floor").remainder(S)
    if query_offset:
        entry_query = entry_query + query_offset

    # List boundaries by binary search on the sorted ids: contention-free even when one list holds every query.
    bounds = torch.searchsorted(sorted_list, torch.arange(L + 1, device=dev, dtype=torch.int32))
    return entry_query, entry_dest, bounds, NB


def recut(plan: SparsePlan, tile_queries: int, tiles_per_item: int) -> SparsePlan:
    """The same sorted lists cut into items of another kernel's tiles (the KL pass after the forward, the proxy
    backward after the main one): no second sort."""
    tq = _positive_int("recut", "tile_queries", tile_queries)
    T = _positive_int("recut", "tiles_per_item", tiles_per_item)
    items, item_count, W = _cut_items(plan.list_bounds, plan.NB, plan.E, tq * T)
    return dataclasses.replace(plan, items=items, item_count=item_count, W=W, tile_queries=tq, tiles_per_item=T)


def _cut_items(bounds: torch.Tensor, NB: int, E: int, C: int):
    """(items [W, 4], item_count [1], W): every list cut into items of at most C entries (see sparse_plan)."""
    L = bounds.shape[0] - 1
    W = -(-E // C) + L
    dev = bounds.device
    list_start, counts = bounds[:-1], bounds[1:] - bounds[:-1]  # int64 (L,)
    chunks = torch.div(counts + (C - 1), C, rounding_mode="floor")
    chunk_end = torch.cumsum(chunks, 0)  # items up to and including list l
    w = torch.arange(W, device=dev, dtype=torch.int64)
    lw = torch.searchsorted(chunk_end, w, right=True)  # the list of item w; L past the real count
    real = lw < L
    lc = lw.clamp(max=L - 1)
    chunk = w - (chunk_end[lc] - chunks[lc])
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    items = torch.stack([
        torch.where(real, torch.div(lc, NB, rounding_mode="floor"), zero),
        torch.where(real, lc.remainder(NB), zero),
        torch.where(real, list_start[lc] + chunk * C, zero),
        torch.where(real, (counts[lc] - chunk * C).clamp(0, C), zero),
    ], dim=1).to(torch.int32)
    return items, chunk_end[-1:].to(torch.int32), W


# --- every chunk's plan from one sort ------------------------------------------------------------------------

ORDERS = ("list", "size", "query", "bins")


def chunk_plans(block_indices: torch.Tensor, block_size: int, group: int, heads: int, queries: int,
                cuts: tuple[tuple[int, int], ...], order: str = "list", arch: str = "",
                key_offset: int = 0, keep_lists: bool = False, take_lists: bool = False,
                bin_queries: int = 2048) -> dict[tuple[int, int], tuple[SparsePlan, ...]]:
    """The plans of every chunk of `heads` proxy heads x `queries` queries of block_indices (B, Hp, S, K), from one
    stable sort: {(p0, s0): (plan, ...)} with one plan per (tile_queries, tiles_per_item) in cuts, each equal
    field for field (items up to its W) to sparse_plan(block_indices[:, p0:p0 + heads, s0:s1], block_size,
    s1 - s0, group, tile_queries, tiles_per_item, query_offset=s0). Its tensors are views of shared arrays.
    order: "list" (list-major, sparse_plan's order; the deterministic backward's turns need it) or "size": the
    same items longest first (a stable sort on their entry counts: the full items keep their list order, the
    lists' partial remainders follow from the longest down), so a launch ends on its shortest items instead of
    wherever the last lists' remainders fall (longest-processing-time-first for the grid's tail); or "query": the
    items of each (b, p) by the query bin (tuning.plan's query_bin queries) of their first entry, list order inside
    a bin, so the CTAs resident at once gather and reduce into the rows of a few bins (the backward's fp32 dq
    reductions, 10x the L2 in list order, mostly miss it); or "bins": each list cut at every multiple of
    bin_queries queries of its chunk before its cut into items, and the items ordered by (bp, bin, j), so an item's
    rows lie in one bin and the CTAs resident at once reduce into one bin's dq rows (more, shorter items; the other
    orders' items are the same items reordered). arch: the tuning policy's (tuning.plan). An item's entries are
    sorted by query, so its rows span a contiguous query range in every order.
    key_offset: keys longer than the queries (sparse_plan's); such plans sort with torch (the plan_lists kernels'
    bitmaps are laid out for query rows that are key positions).
    keep_lists, take_lists: the plan_lists kernels' sorted lists are left on block_indices for a later plan of
    the same selection, which takes them instead of sorting again (kept_lists). The MSA forward keeps, its
    backward takes (and its proxy lse pass both); every other plan sorts. So the lists only cross from a forward to
    the backward of the selection it saved, which nothing writes in between.

    Why. The forward and the backward run in chunks (bounded partial buffers), and each sparse_plan is ~45 small
    torch ops on the host: at (a) S = 64K, B = 2 the host took 11-13 ms to enqueue the 8 forward chunks' plans,
    recuts and launches against ~19 ms of GPU work (4.3-5.4 ms with this).
    Here the chunk is the major sort key, so chunk c's entries, dead ones last, fill the shape-static range [sum of
    the earlier chunks' E, + its own E) of one sorted array, and all chunks' items are cut in one batched pass.
    """
    B, Hp, S, K = block_indices.shape
    if order not in ORDERS:
        raise ValueError(f"chunk_plans: order = {order!r}; supported: {', '.join(map(repr, ORDERS))}")
    if order == "bins":
        _positive_int("chunk_plans", "bin_queries", bin_queries)
    if Hp % heads or queries % block_size and queries < S:
        raise ValueError(f"chunk_plans: heads = {heads} must divide Hp = {Hp} and queries = {queries} be a multiple "
                         f"of block_size = {block_size} (or cover S = {S})")
    t = tuning_plan.choose(arch)
    ck = lists_on_device(block_indices, block_size, group, heads, queries) if not key_offset else None
    if ck is not None:
        return _kernel_plans(block_indices, block_size, group, heads, queries, cuts, order, ck=ck,
                             keep_lists=keep_lists, take_lists=take_lists, bin_queries=bin_queries)
    group_ck = lists_on_device(block_indices[:, :heads], block_size, group, heads, queries) \
        if heads < Hp and not key_offset else None
    if group_ck is not None:
        return _head_group_plans(block_indices, block_size, group, heads, queries, cuts, order, group_ck,
                                 bin_queries)
    # One chunk: sparse_plan's sort (fewer torch ops), every cut in one pass ("bins" cuts in _batch_plans).
    if heads == Hp and queries >= S and order != "bins":
        entry_query, entry_dest, bounds, NB = _sorted_lists(block_indices, block_size, 0, key_offset)
        E, L, dev = B * Hp * S * K, bounds.shape[0] - 1, bounds.device
        counts = (bounds[1:] - bounds[:-1]).view(1, L)
        items, item_count, W = _cut_batched(bounds[:-1].view(1, L), counts,
                                            torch.full((1,), NB, dtype=torch.int64, device=dev), cuts, [E], [L],
                                            order == "size")
        if order == "query":
            items = _by_query(items, entry_query, torch.zeros(1, dtype=torch.int64, device=dev), t.query_bin)
        return {(0, 0): tuple(
            SparsePlan(entry_query=entry_query, entry_dest=entry_dest, items=items[n, 0, :W[n][0]],
                       item_count=item_count[n, :1], list_bounds=bounds, E=E, W=W[n][0], K=K, Hp=Hp, S=S, B=B,
                       NB=NB, block_size=block_size, group=group, tile_queries=tq, tiles_per_item=T,
                       key_offset=key_offset)
            for n, (tq, T) in enumerate(cuts))}
    per_batch = max(1, t.batch_entries // max(1, B * Hp * K * queries)) * queries
    plans = {}
    for r0 in range(0, S, per_batch):
        batch = block_indices[:, :, r0:min(S, r0 + per_batch)]
        plans.update(_batch_plans(batch, r0, block_size, group, heads, queries, cuts, order, key_offset,
                                  bin_queries))
    return plans


def _batch_plans(block_indices, query_offset, block_size, group, heads, queries, cuts, item_order, key_offset=0,
                 bin_queries=2048):
    """chunk_plans of the query rows [query_offset, + block_indices.shape[2]) (the chunks start at query_offset;
    row i at key position key_offset + i)."""
    B, Hp, S, K = block_indices.shape
    Bs, c, dev = block_size, heads, block_indices.device
    # chunk ch = (p // c) * n_q + query chunk; host-side sizes per chunk:
    ck = chunk_keys(B, Hp, S, K, c, queries, Bs, query_offset, key_offset)
    n_q, n_ch, q_lo, q_hi, NB, L, E = ck.n_q, len(ck.E), ck.q_lo, ck.q_hi, ck.NB, ck.L, ck.E
    if max(e * group for e in E) >= _INT32_LIMIT or sum(n + 1 for n in L) >= _INT32_LIMIT:
        raise ValueError(f"chunk_plans: block_indices {tuple(block_indices.shape)} with group = {group}: a chunk "
                         f"holds past int32 (< 2**31) partial rows or lists: use smaller chunks")
    # The same sizes on the device, from aranges (no host-to-device copy: capturable).
    i32, i64 = torch.int32, torch.int64
    ch_t = torch.arange(n_ch, device=dev, dtype=i64)
    lo_t = query_offset + (ch_t % n_q) * queries
    hi_t = torch.clamp(lo_t + queries, max=query_offset + S)
    NB_t = torch.div(hi_t + (key_offset + Bs - 1), Bs, rounding_mode="floor")
    L_t = B * c * NB_t
    base_t = torch.cumsum(L_t + 1, 0) - (L_t + 1)  # first key of each chunk's lists
    E_t = B * c * (hi_t - lo_t) * K
    off_t = torch.cumsum(E_t, 0) - E_t  # first sorted entry of each chunk

    # Key of every entry (b, p, r, slot): base[chunk] + its list in the chunk, (b * c + p % c) * NB + j, or the
    # chunk's dead list L for a dead slot.
    live = live_slots(block_indices, Bs, key_offset + query_offset)
    p = torch.arange(Hp, device=dev, dtype=i64).view(1, Hp, 1, 1)
    b = torch.arange(B, device=dev, dtype=i64).view(B, 1, 1, 1)
    if n_q == 1:  # chunks of heads only: the chunk is p // c, so per-(b, p) int32 tables do the arithmetic
        ch = torch.div(p, c, rounding_mode="floor")
        first = (base_t[ch] + (b * c + p.remainder(c)) * NB_t[ch]).to(i32)  # (B, Hp, 1, 1)
        key = torch.where(live, block_indices + first, (base_t[ch] + L_t[ch]).to(i32))
    else:
        r = torch.arange(S, device=dev, dtype=i64).view(1, 1, S, 1)
        ch = (torch.div(p, c, rounding_mode="floor") * n_q + torch.div(r, queries, rounding_mode="floor"))
        lists = (b * c + p.remainder(c)) * NB_t[ch] + block_indices
        key = (base_t[ch] + torch.where(live, lists, L_t[ch])).to(i32)
        del lists
    sorted_key, order = torch.sort(key.reshape(-1), stable=True)
    del key, live
    # Decode each sorted entry: its query, and its row in its chunk's (B, c, length, K) partial grid (int32: a
    # batch holds fewer than tuning.plan's batch_entries entries).
    order = order.to(i32)
    rest = torch.div(order, K, rounding_mode="floor")
    row = rest.remainder(S)
    entry_query = row + query_offset if query_offset else row
    if n_q == 1:  # the flat (B, Hp, S, K) index less the rows of the other chunks before it: a per-(b, p) table
        bp = torch.arange(B * Hp, device=dev, dtype=i64)
        p_t = bp.remainder(Hp)
        skipped = (torch.div(bp, Hp, rounding_mode="floor") * (Hp - c) + p_t - p_t.remainder(c)) * (S * K)
        entry_dest = order - skipped.to(i32)[torch.div(rest, S, rounding_mode="floor")]
    else:
        slot = order - rest * K
        rest = torch.div(rest, S, rounding_mode="floor")
        p_e, b_e = rest.remainder(Hp), torch.div(rest, Hp, rounding_mode="floor")
        qi = torch.div(row, queries, rounding_mode="floor")
        length = torch.clamp(S - qi * queries, max=queries)
        entry_dest = (((b_e * c + p_e.remainder(c)) * length + row - qi * queries) * K + slot).to(i32)
    bounds = torch.searchsorted(sorted_key, torch.arange(sum(n + 1 for n in L) + 1, device=dev, dtype=i32))
    # Per chunk, its lists' relative starts and counts, padded to the longest chunk's L with empty lists.
    L_max = max(L)
    col = torch.arange(L_max + 1, device=dev, dtype=i64).view(1, -1)
    index = torch.clamp(base_t.view(-1, 1) + col, max=bounds.shape[0] - 1)
    starts = bounds[index] - off_t.view(-1, 1)  # (n_ch, L_max + 1): list starts, then the dead list's
    valid = col[:, :L_max] < L_t.view(-1, 1)
    counts = torch.where(valid, starts[:, 1:] - starts[:, :-1], torch.zeros((), dtype=i64, device=dev))
    if item_order == "bins":
        end_t = off_t + E_t
        cut = _cut_in_bins(entry_query, starts, counts, off_t, end_t, lo_t, NB_t, cuts, ck, B * c, Bs, key_offset,
                           bin_queries)
    else:
        cut = _cut_batched(starts[:, :-1], counts, NB_t, cuts, E, L, item_order == "size")
    return _chunk_plan_dict(entry_query, entry_dest, starts, cut, off_t, q_lo, q_hi, NB, L, E, B, K, c, n_q, Bs,
                            group, cuts, item_order, key_offset)


def _chunk_plan_dict(entry_query, entry_dest, starts, cut, off_t, q_lo, q_hi, NB, L, E, B, K, c, n_q, Bs, group,
                     cuts, item_order, key_offset=0):
    """chunk_plans' result from the chunks' sorted entries: starts (n_ch, L_max + 1) int64, each chunk's list starts
    relative to its first entry with the dead entries' start at column L[n]; cut = (items, item_count, W) as
    _cut_batched gives them (in item_order "size" already longest first); off_t (n_ch,) on the device: each chunk's
    first entry, read by order "query" only; q_lo, q_hi, NB, L, E: per chunk, host ints."""
    items, item_count, W = cut
    if item_order == "query":
        items = _by_query(items, entry_query, off_t, tuning_plan.choose("").query_bin)

    # Every plan's views from one split per field (each view is a torch op of host time, and small problems are
    # host-bound): entries per chunk, items per (cut, chunk) (the even pieces: its W rows, then padding to W_max).
    n_ch, W_max = len(E), items.shape[2]
    queries, dests = (entry_query.split(E), entry_dest.split(E)) if n_ch > 1 else ((entry_query,), (entry_dest,))
    item_rows = items.reshape(-1, 4).split([w for cut in W for n in range(n_ch) for w in (cut[n], W_max - cut[n])])
    counts, chunk_starts = item_count.reshape(-1).split(1), starts.unbind(0)
    plans = {}
    for n in range(n_ch):
        p0, s0 = (n // n_q) * c, q_lo[n]
        chunk_bounds = chunk_starts[n] if L[n] + 1 == starts.shape[1] else chunk_starts[n][:L[n] + 1]
        plans[(p0, s0)] = tuple(
            SparsePlan(entry_query=queries[n], entry_dest=dests[n], items=item_rows[2 * (m * n_ch + n)],
                       item_count=counts[m * n_ch + n], list_bounds=chunk_bounds,
                       E=E[n], W=W[m][n], K=K, Hp=c, S=q_hi[n] - s0, B=B, NB=NB[n], block_size=Bs, group=group,
                       tile_queries=tq, tiles_per_item=T, query_offset=s0, key_offset=key_offset)
            for m, (tq, T) in enumerate(cuts))
    return plans


# --- the sorted lists by the plan_lists kernels (kernels_src/plan_lists) -------------------------------------------

# The kernels' (key, tile) count matrix holds ~B Hp S^2 / (Bs 128) int32 cells (twice: counts and their cumsum);
# past tuning.plan's max_cells chunk_plans sorts one head group at a time, and past it for one group the torch
# sort, batched, takes less memory.


@dataclasses.dataclass(frozen=True)
class ChunkKeys:
    """The plan_lists kernels' key layout (their tile_keys): chunk n = (head group, query chunk), every chunk but the
    last of a head group holding `queries` queries; chunk n's keys are its L[n] lists (b, p', j), then one dead
    key per (b, p')."""

    queries: int
    tiles: int  # columns of the (key, tile) matrices
    q_lo: list
    q_hi: list
    NB: list
    L: list
    E: list
    n_q: int
    keys: int

    @property
    def cells(self) -> int:
        return self.keys * self.tiles


def chunk_keys(B: int, Hp: int, S: int, K: int, heads: int, queries: int, block_size: int,
               query_offset: int = 0, key_offset: int = 0) -> ChunkKeys:
    """The chunks of `heads` proxy heads x `queries` queries of a (B, Hp, S, K) selection whose rows are queries
    [query_offset, query_offset + S) (at key positions key_offset on): their query ranges, blocks, lists and
    entries (host ints), and the keys."""
    Q = min(queries, S)
    n_q = -(-S // Q)
    n_ch = (Hp // heads) * n_q
    q_lo = [query_offset + (n % n_q) * Q for n in range(n_ch)]
    q_hi = [min(query_offset + S, lo + Q) for lo in q_lo]
    NB = [-(-(key_offset + hi) // block_size) for hi in q_hi]
    bc = B * heads
    L = [bc * nb for nb in NB]
    E = [bc * (hi - lo) * K for lo, hi in zip(q_lo, q_hi)]
    tiles = -(-Q // tuning_plan.choose("").tile_rows)
    return ChunkKeys(queries=Q, tiles=tiles, q_lo=q_lo, q_hi=q_hi, NB=NB, L=L, E=E, n_q=n_q, keys=sum(n + bc for n in L))


def lists_on_device(block_indices: torch.Tensor, block_size: int, group: int, heads: int,
                    queries: int) -> ChunkKeys | None:
    """The chunks' ChunkKeys where chunk_plans sorts with the plan_lists kernels, else None: CUDA tensors, a built
    block size, query chunks of whole kernel tiles, K within the widest variant's registers, and int32 positions
    and cells. Otherwise the torch sort runs (and raises where a chunk's partial rows pass int32)."""
    t = tuning_plan.choose("")
    if not (t.lists_on_device and block_indices.is_cuda and block_size in t.list_block_sizes):
        return None
    B, Hp, S, K = block_indices.shape
    if queries < S and queries % t.tile_rows or not 1 <= K <= LIST_MAX_KS[-1] or B * Hp * S == 0:
        return None
    ck = chunk_keys(B, Hp, S, K, heads, queries, block_size)
    fits = (sum(ck.E) < _INT32_LIMIT and max(ck.E) * group < _INT32_LIMIT and ck.cells <= t.max_cells
            and ck.keys < _INT32_LIMIT)
    return ck if fits else None


ITEM_THREADS = 512  # kernels_src.plan_lists.ITEM_THREADS
ITEM_CUTS = 2  # cuts one plan_items launch makes


LIST_MAX_KS = (16, 64)  # kernels_src.plan_lists.MAX_KS: slots per row a variant holds in registers


def list_kernel_configs(block_size: int, K: int | None = None, arch: str = "") -> list[tuple[str, dict]]:
    """The (op, config) of the plan kernels chunk_plans launches for K slots per row: count, scatter (the smallest
    max_k >= K), then the items cut; K None: every variant any K may launch."""
    max_ks = LIST_MAX_KS if K is None else (next(m for m in LIST_MAX_KS if K <= m),)
    t = tuning_plan.choose(arch)

    def threads(m, phase):
        return t.scatter_threads if phase == "scatter" and m == LIST_MAX_KS[0] else t.tile_rows

    return [("plan_lists", {"block_size": block_size, "max_k": m, "phase": phase, "threads": threads(m, phase)})
            for m in max_ks for phase in ("count", "scatter")] + \
        [("plan_items", {"block_size": block_size, "threads": ITEM_THREADS})]


def _lists_kernels(block_size: int, K: int, device):
    from flash_msa_rt.loader import get_kernel

    return tuple(get_kernel(op, config, device) for op, config in list_kernel_configs(block_size, K))


def sorted_lists_on_device(block_indices: torch.Tensor, block_size: int, heads: int, queries: int, kernels=None,
                           ck: ChunkKeys | None = None):
    """(entry_query, entry_dest, lists (n_ch, 2, L_max + 1) int64, ChunkKeys) of every chunk, sorted by the
    plan_lists kernels: lists[n, 0] the chunk's list starts relative to its first entry (column L[n]: the dead
    entries' start), lists[n, 1] their counts (0 past L[n]). kernels: the (count, scatter) launchers (default:
    the built kernels; tests pass an emulation); ck: the chunks' keys when the caller has them."""
    B, Hp, S, K = block_indices.shape
    ck = ck or chunk_keys(B, Hp, S, K, heads, queries, block_size)
    dev = block_indices.device
    count, scatter = (kernels or _lists_kernels(block_size, K, dev))[:2]
    sel = block_indices if block_indices.stride(3) == 1 else block_indices.contiguous()
    scalars = dict(heads=heads, queries=ck.queries, tiles=ck.tiles)
    counts = torch.zeros(ck.cells, dtype=torch.int32, device=dev)
    count(block_indices=sel, counts=counts, **scalars)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    entry_query = torch.empty(sum(ck.E), dtype=torch.int32, device=dev)
    entry_dest = torch.empty(sum(ck.E), dtype=torch.int32, device=dev)
    lists = torch.zeros((len(ck.E), 2, max(ck.L) + 1), dtype=torch.int64, device=dev)
    scatter(block_indices=sel, counts=counts, ends=ends, entry_query=entry_query, entry_dest=entry_dest, lists=lists,
            **scalars)
    return entry_query, entry_dest, lists, ck


def _head_group_plans(block_indices, block_size, group, heads, queries, cuts, order, ck, bin_queries=2048):
    """chunk_plans on the plan_lists kernels, one sort per group of `heads` proxy heads (a head-sliced view, whose
    chunks' plans are the whole selection's: a chunk's plan is its own slice's either way), for selections whose
    count matrices of all chunks at once would pass tuning.plan's max_cells: at (b) S = 1M, B = 1 one head's are
    67M cells where all eight heads' are 537M. ck: one group's ChunkKeys (every group has the same). No kept lists:
    a view's attribute would not outlive the call, and such selections pass keep_lists_entries anyway."""
    plans = {}
    for p0 in range(0, block_indices.shape[1], heads):
        part = _kernel_plans(block_indices[:, p0:p0 + heads], block_size, group, heads, queries, cuts, order, ck=ck,
                             bin_queries=bin_queries)
        plans.update({(p0 + p, s0): plan for (p, s0), plan in part.items()})
    return plans


def _kernel_plans(block_indices, block_size, group, heads, queries, cuts, order, kernels=None, ck=None,
                  keep_lists: bool = False, take_lists: bool = False, bin_queries: int = 2048):
    """chunk_plans on the plan_lists kernels (kernels, ck: as sorted_lists_on_device's): the same plans, field for
    field, as the torch sort's. keep_lists, take_lists: as chunk_plans' (with the built kernels only)."""
    B, Hp, S, K = block_indices.shape
    key = kept_lists_key(block_indices, block_size, heads, min(queries, S)) if kernels is None else None
    kernels = kernels or _lists_kernels(block_size, K, block_indices.device)
    sorted_lists = (kept_lists(block_indices, key) if take_lists else None) or \
        sorted_lists_on_device(block_indices, block_size, heads, queries, kernels, ck)
    entry_query, entry_dest, lists, ck = sorted_lists
    if keep_lists and key is not None and sum(ck.E) <= tuning_plan.choose("").keep_lists_entries \
            and _KEEP_ACROSS_OPS.get():
        setattr(block_indices, _KEPT_LISTS, (key, sorted_lists))
    dev, n_ch = block_indices.device, len(ck.E)
    if order == "bins":
        off_t = _chunk_offsets(ck, dev)
        lo_t, hi_t, NB_t = _chunk_ranges(ck, S, block_size, dev)
        end_t = off_t + B * heads * (hi_t - lo_t) * K
        cut = _cut_in_bins(entry_query, lists[:, 0], lists[:, 1, :-1], off_t, end_t, lo_t, NB_t, cuts, ck, B * heads,
                           block_size, 0, bin_queries)
    elif len(cuts) <= ITEM_CUTS:
        cut = _cut_on_device(kernels[2], lists, ck, B * heads, cuts)
        if order == "size":
            cut = (_longest_first(cut[0]), *cut[1:])
    else:  # more cuts than one launch makes (tests): the torch cut of the same lists
        cut = _cut_batched(lists[:, 0, :-1], lists[:, 1, :-1], _chunk_ranges(ck, S, block_size, dev)[2], cuts, ck.E,
                           ck.L, order == "size")
    off_t = _chunk_offsets(ck, dev) if order == "query" else None
    return _chunk_plan_dict(entry_query, entry_dest, lists[:, 0], cut, off_t, ck.q_lo, ck.q_hi, ck.NB, ck.L, ck.E, B,
                            K, heads, ck.n_q, block_size, group, cuts, order)


# The sorted lists a plan left on its selection tensor (chunk_plans' keep_lists): (kept_lists_key, the result of
# sorted_lists_on_device). An attribute of the tensor object, so it lives exactly as long as the selection (autograd
# keeps the object it saves for the backward) and no other tensor that reuses its memory can find it.
_KEPT_LISTS = "_flash_msa_sorted_lists"


# Whether a plan may leave its sorted lists on the selection for a later op (keep_lists). The eager path's one
# autograd.Function may: its backward node holds the selection, and so the lists, until the backward takes them.
# The custom ops may not (ops_keep_no_lists): under torch.compile the lists would outlive the graph that made them
# as tensors that no graph output or saved tensor accounts for, which CUDA graph trees (mode="reduce-overhead")
# refuse ("tensors in the cudagraph pool not tracked as outputs"); their backward sorts the selection again.
_KEEP_ACROSS_OPS: contextvars.ContextVar[bool] = contextvars.ContextVar("flash_msa_keep_lists", default=True)


def keeps_across_ops() -> bool:
    """Whether an op may leave what it derived from a selection on the selection object (not in a custom op's
    body: ops_keep_no_lists)."""
    return _KEEP_ACROSS_OPS.get()


@contextlib.contextmanager
def ops_keep_no_lists():
    """Within the block, no plan leaves its sorted lists on a selection (a custom op's body: library)."""
    token = _KEEP_ACROSS_OPS.set(False)
    try:
        yield
    finally:
        _KEEP_ACROSS_OPS.reset(token)


def kept_lists_key(block_indices: torch.Tensor, block_size: int, heads: int, queries: int) -> tuple:
    """What the sorted lists depend on besides the selection's values: its version counter (any in-place write
    through torch bumps it), block size and chunks."""
    return (block_indices._version, block_size, heads, queries)


def kept_lists(block_indices: torch.Tensor, key: tuple | None):
    """The sorted lists left on block_indices for key, taken off it (the next plan sorts again unless it keeps
    them too), or None."""
    kept = getattr(block_indices, _KEPT_LISTS, None) if key is not None else None
    if kept is None:
        return None
    delattr(block_indices, _KEPT_LISTS)
    return kept[1] if kept[0] == key else None


def _cut_on_device(items_kernel, lists: torch.Tensor, ck: ChunkKeys, lists_per_block: int, cuts):
    """_cut_batched's (items, item_count, W) in list order by the plan_items kernel, from phase 2's lists table."""
    sizes = [tq * T for tq, T in cuts]
    W = [[-(-e // C) + n for e, n in zip(ck.E, ck.L)] for C in sizes]
    W_max, dev = max(max(w) for w in W), lists.device
    items = torch.empty((len(sizes), len(ck.E), W_max, 4), dtype=torch.int32, device=dev)
    item_count = torch.empty((len(sizes), len(ck.E)), dtype=torch.int32, device=dev)
    # q_hi[-1]: the last chunk ends at S
    items_kernel(lists=lists, items=items, item_count=item_count, seqlen=ck.q_hi[-1], queries=ck.queries,
                 lists_per_block=lists_per_block, entries0=sizes[0], entries1=sizes[-1])
    return items, item_count, W


def _chunk_ranges(ck: ChunkKeys, S: int, block_size: int, device):
    """(lo, hi, NB) (n_ch,) int64 on the device: each chunk's query range and key blocks, made from an arange (no
    host-to-device copy: capturable)."""
    qc = torch.arange(len(ck.E), device=device, dtype=torch.int64).remainder(ck.n_q)
    lo = qc * ck.queries
    hi = torch.clamp(lo + ck.queries, max=S)
    return lo, hi, torch.div(hi + (block_size - 1), block_size, rounding_mode="floor")


def _chunk_offsets(ck: ChunkKeys, device) -> torch.Tensor:
    """(n_ch,) int64 on the device: each chunk's first sorted entry, from aranges (every chunk but a head group's
    last query chunk holds E[0] entries)."""
    n = torch.arange(len(ck.E), device=device, dtype=torch.int64)
    hg, qc = torch.div(n, ck.n_q, rounding_mode="floor"), n.remainder(ck.n_q)
    return hg * sum(ck.E[:ck.n_q]) + qc * ck.E[0]


def _cut_batched(list_start, counts, NB_t, cuts, E: list[int], L: list[int], by_size: bool = False):
    """_cut_items of every chunk and every (tile_queries, tiles_per_item) cut at once: list_start, counts (n_ch,
    L_max) int64 (padding lists empty), NB_t (n_ch,), E and L per chunk -> (items (n_cuts, n_ch, W_max, 4) int32,
    item_count (n_cuts, n_ch) int32, W[cut][chunk]). by_size: each chunk's items longest first (stable, so the
    full items keep their list order; the empty rows past the real count stay last).
    The cuts are a leading dimension over broadcast views (no copies of the chunks' lists per cut), and the three
    per-list values an item needs come from one gather: small problems are host-bound, ~20 us per torch op."""
    sizes = [tq * T for tq, T in cuts]
    W = [[-(-e // C) + n for e, n in zip(E, L)] for C in sizes]
    W_max, L_max, n_ch = max(max(w) for w in W), counts.shape[1], counts.shape[0]
    n_cuts, dev, i64 = len(sizes), counts.device, torch.int64
    C = _per_cut(sizes, dev)  # an int, or (n_cuts, 1, 1)
    chunks = torch.div(counts.unsqueeze(0) + (C - 1), C, rounding_mode="floor")  # (n_cuts, n_ch, L_max)
    chunk_end = torch.cumsum(chunks, 2)  # items up to and including list l
    shape = (n_cuts, n_ch, L_max)
    # per list: its first entry, its entries, the items before it
    table = torch.stack([list_start.expand(shape), counts.expand(shape), chunk_end - chunks], dim=3)
    w = torch.arange(W_max, device=dev, dtype=i64).expand(n_cuts, n_ch, W_max).contiguous()
    lw = torch.searchsorted(chunk_end, w, right=True)  # the list of item w; L_max past the real count
    lc = lw.clamp(max=L_max - 1)
    at = table.gather(2, lc.unsqueeze(3).expand(n_cuts, n_ch, W_max, 3))
    offset = (w - at[..., 2]) * C  # the item's first entry within its list
    bp = torch.div(lc, NB_t.view(1, n_ch, 1), rounding_mode="floor")
    # (bp, j, entry_start, n_entries); the rows past the real count are zeros
    items = torch.stack([bp, lc - bp * NB_t.view(1, n_ch, 1), at[..., 0] + offset, (at[..., 1] - offset).clamp(max=C)],
                        dim=3)
    items = (items * (lw < L_max).unsqueeze(3)).to(torch.int32)
    if by_size:
        items = _longest_first(items)
    return items, chunk_end[..., -1].to(torch.int32), W


def _cut_in_bins(entry_query, starts, counts, off_t, end_t, lo_t, NB_t, cuts, ck: ChunkKeys, bc: int, Bs: int,
                 key_offset: int, Q: int):
    """_cut_batched's (items, item_count, W) for item order "bins": each list (bp, j) of a chunk cut at the chunk's
    query bins [lo + m Q, lo + (m + 1) Q) into sub-lists, which are cut into items in (bp, m, j) order.
    entry_query (E_total,) every chunk's sorted entries; starts (n_ch, L_max + 1) relative list starts (column
    L[n]: the dead entries'), counts (n_ch, L_max) (0 past L[n]); off_t, end_t, lo_t, NB_t (n_ch,) on the device:
    each chunk's first and past-last entry, first query and blocks; ck: the chunks' host sizes; bc = B * heads.
    Capturable: the bins' bounds come from one searchsorted over a key that is monotone in sorted order
    (list-major, then bin), and W from shapes alone. Memory: a few int64 temporaries per entry and five per
    (list, bin) and cut, e.g. ~0.5 GB at (b) 64K, B = 2 with bins of 4096, several GB at 1M tokens."""
    i32, i64, dev = torch.int32, torch.int64, entry_query.device
    n_ch, L_max = counts.shape
    nbins = max(-(-(hi - lo) // Q) for lo, hi in zip(ck.q_lo, ck.q_hi))
    L_t = bc * NB_t
    col = torch.arange(L_max + 1, device=dev, dtype=i64).view(1, -1)
    # Each entry's (chunk, list column): the last list start at or before it, over starts made monotone (the
    # padding columns past a chunk's dead list start where the chunk ends).
    gstart = torch.where(col <= L_t.view(-1, 1), starts + off_t.view(-1, 1), end_t.view(-1, 1)).reshape(-1)
    e = torch.arange(entry_query.shape[0], device=dev, dtype=i64)
    flat = torch.searchsorted(gstart, e, right=True) - 1
    chunk = torch.div(flat, L_max + 1, rounding_mode="floor")
    live = flat - chunk * (L_max + 1) < L_t[chunk]
    # The bin of a live entry (queries ascend inside a list); the dead list's entries all in bin 0.
    m = torch.where(live, torch.div(entry_query - lo_t[chunk], Q, rounding_mode="floor"), 0).clamp_(0, nbins - 1)
    key = flat * nbins + m
    del e, chunk, live, m
    n_sub = n_ch * (L_max + 1) * nbins
    bounds = torch.searchsorted(key, torch.arange(n_sub + 1, device=dev, dtype=i64))
    del key, flat
    sub_start = bounds[:-1].view(n_ch, L_max + 1, nbins)
    sub_count = (bounds[1:] - bounds[:-1]).view(n_ch, L_max + 1, nbins)
    # Reordered to (bp, m, j) per chunk: position t holds list column bp NB + j, bin m.
    t = torch.arange(L_max * nbins, device=dev, dtype=i64).view(1, -1)
    per_bp = (nbins * NB_t).view(-1, 1)
    bp = torch.div(t, per_bp, rounding_mode="floor")
    rest = t - bp * per_bp
    mb = torch.div(rest, NB_t.view(-1, 1), rounding_mode="floor")
    src_col = bp * NB_t.view(-1, 1) + rest - mb * NB_t.view(-1, 1)
    valid = src_col < L_t.view(-1, 1)
    src = (src_col.clamp(max=L_max) * nbins + mb).clamp(max=(L_max + 1) * nbins - 1)
    sub_start = sub_start.reshape(n_ch, -1).gather(1, src) - off_t.view(-1, 1)
    sub_count = torch.where(valid, sub_count.reshape(n_ch, -1).gather(1, src), 0)
    # Sub-lists that can hold entries: block j has a causal key for bin m's last query.
    Lb = [bc * sum(min(nb, (key_offset + min(lo + (k + 1) * Q, hi) - 1) // Bs + 1) for k in range(-(-(hi - lo) // Q)))
          for lo, hi, nb in zip(ck.q_lo, ck.q_hi, ck.NB)]
    items, item_count, W = _cut_batched(sub_start, sub_count, nbins * NB_t, cuts, ck.E, Lb)
    j = items[..., 1].to(i64).remainder(NB_t.view(1, -1, 1)).to(i32)  # column m NB + j -> j
    return torch.cat([items[..., :1], j.unsqueeze(-1), items[..., 2:]], dim=-1), item_count, W


def _longest_first(items: torch.Tensor) -> torch.Tensor:
    """items (n_cuts, n_ch, W_max, 4) of each chunk longest first, stable (the empty rows past the count stay last)."""
    longest = torch.sort(items[..., 3], dim=2, descending=True, stable=True).indices
    return items.gather(2, longest.unsqueeze(3).expand(*items.shape))


def _per_cut(sizes: list[int], device):
    """The cuts' item sizes (entries): the int itself for one cut, else an (n_cuts, 1, 1) int64 tensor made on the
    device from an arange (a tensor from a Python list would be a host-to-device copy, which capture forbids)."""
    if len(sizes) == 1:
        return sizes[0]
    cut = torch.arange(len(sizes), device=device, dtype=torch.int64).view(-1, 1, 1)
    if len(sizes) == 2:  # every runtime call: (s1 - s0) * cut + s0
        return cut * (sizes[1] - sizes[0]) + sizes[0]
    out = torch.full_like(cut, sizes[0])
    for k, size in enumerate(sizes[1:], 1):
        out = torch.where(cut == k, size, out)
    return out


def _by_query(items: torch.Tensor, entry_query: torch.Tensor, first_entry: torch.Tensor,
              query_bin: int) -> torch.Tensor:
    """items (n_cuts, n_ch, W_max, 4) of chunk_plans reordered per chunk by (bp, query bin of the first entry),
    stable (list order inside a bin); first_entry (n_ch,): each chunk's first sorted entry in entry_query. The
    empty rows past the real count (n_entries = 0) stay last."""
    i64 = torch.int64
    start = items[..., 2].to(i64) + first_entry.view(1, -1, 1)
    query = entry_query[start.clamp(max=entry_query.shape[0] - 1)].to(i64)
    bins = _INT32_LIMIT // query_bin + 1  # more than any query's bin (queries are int32)
    key = items[..., 0].to(i64) * bins + torch.div(query, query_bin, rounding_mode="floor")
    key = torch.where(items[..., 3] > 0, key, torch.full((), torch.iinfo(i64).max, dtype=i64, device=key.device))
    order = torch.sort(key, dim=2, stable=True).indices
    return items.gather(2, order.unsqueeze(-1).expand(*order.shape, 4))
