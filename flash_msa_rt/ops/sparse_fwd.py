"""The sparse forward's launcher: MSA main attention + proxy lse + KL on the GPU, KV-outer.

Steps, all on the device with no host synchronisation:
  0. the queries are cut into chunks whose partial buffers fit PARTIALS_BUDGET; per chunk:
  1. sparse_plan: the reverse index (key block -> the queries that chose it), cut into bounded work items (every
     chunk's at once: chunk_plans);
  2. sparse_fwd kernel: per (entry, head) the one-block partial output and its lse;
  3. sparse_combine kernel: logsumexp merge of each row's K slots -> out, lse;
  4. sparse_kl kernel (its own plan: tiles of 64 distinct queries): with the final lse, each entry's (A, T, L)
     shares of the KL and of the proxy lse per key group;
  5. sparse_combine_kl kernel: lse_proxy and kl_rows (KL = ln 2 * sum A + lse_proxy * sum T; its torch statement
     is sparse_plan.combine_kl_lse).
Internal layout (B, S, heads, D); the public API validates user input and routes here through dispatch.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops.sparse_plan import chunk_plans, kl_groups, list_kernel_configs, sparse_plan

DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}
HEAD_DIMS = (128,)
BLOCK_SIZES = (128,)
GROUPS = (1, 2, 4, 8, 16)
TILE_M = 128
# Work items: one key block and at most this many tiles of its queries (bounds the hot blocks). Larger items load
# their key block for more tiles; measured by benchmarks/sweep_items.py on the ping-pong forward and the wgmma KL
# pass (results/sweep_items_b_ac5e11f.json, (b) S = 64K): sparse_fwd 18.94 / 17.88 / 17.34 ms at 8 / 16 / 32
# tiles, the KL pass 12.73 / 12.53 / 12.47 at 8 / 16 / 32 (KL_MAIN_TILES_PER_ITEM 128 gives 32 at G = 4). In the
# chunked whole op the gain does not show (fewer, longer items per chunk): (b) 64K forward 40.53 ms at 16 tiles,
# 40.65 at 32 (results/bench_msa_ac5e11f.log, bench_msa_64k_128k_f3ec34b.log). With chunks of heads (whole lists)
# and one sort for every chunk, 64 against 32 in one process (results/ab_tiles_per_item_59e1276.log): whole forward
# (b) / (a) / (c) 64K and (a) B = 1 64K 35.47 -> 34.31, 17.91 -> 17.70, 65.62 -> 64.96, 11.34 -> 11.18 ms.
TILES_PER_ITEM = 64
KL_TILE = 64  # distinct queries per KL tile; the tile visits the G heads one after another
KL_MAIN_TILES_PER_ITEM = 128  # KL items: ~128 // G tiles of 64 queries x G heads, 1 to 32 tiles (per_group_tiles)
# The least bytes of per-slot partials one forward chunk may hold (partials_budget). Each chunk costs four launches'
# ramps and tails: at (a) B = 1, S = 64K, 4 chunks took the forward 9.9-10.4 ms, 1 chunk 8.4-8.5
# (results/ab_budgets_242f55b.log); 2 GiB holds (a) B = 1 up to 64K in two chunks, (a) B = 2 at 64K in four.
PARTIALS_BUDGET = 2 << 30
# Item order of the forward's launches (sparse_plan.chunk_plans): "size", longest first, against "list" in one
# process (results/ab_item_order_242f55b.log): forward (a) / (b) / (c) 64K 18.12 -> 17.30, 32.52 -> 32.23,
# 61.48 -> 60.31 ms, (b) 16K 31.24 -> 30.68; (a) B = 1 64K and 16K within noise (10.36 -> 10.42, 3.41 -> 3.47). The
# backward keeps list order: its main kernel measured 0.6-1 ms slower longest first at (b).
FORWARD_ITEM_ORDER = "size"
KL_PARTIALS_BUDGET = 1 << 30  # bytes of (A, T, L) partials per chunk of msa_kl_cuda (warmup's KL pass alone)


def kernel_config(dtype: str, head_dim: int, block_size: int, group: int, mma: str = "sync",
                  schedule: str | None = None) -> dict:
    """The variant launched for a problem; fields in the order the build names them.
    mma: family_mma(arch, "sparse_fwd"); schedule: fwd_schedule(mma) unless given."""
    schedule = schedule or fwd_schedule(mma)
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group, "tile_m": TILE_M,
            "threads": 256, "stages": fwd_stages(schedule, group), "mma": mma, "schedule": schedule}


# q tile buffers: the ping-pong kernel with one buffer (96 KB) runs two CTAs per SM, and each warpgroup gathers its
# next tile under its softmax, PV and epilogue instead of a tile ahead. One 16K-query chunk, same plan, outputs
# bitwise equal (results/ab_fwd_stages_8fbc399.log), 2 -> 1 buffers: (b) 64K 3.85 -> 3.40 ms, (a) 1.96 -> 1.80, (c)
# G = 16 8.25 -> 6.96 (6.82 with the entries loaded at the tile top, what ships: ab_fwd_knobs_8fbc399.log), (b) 8K
# 14.28 -> 13.59. At G = 1 one buffer spills (16 bytes at the 128 registers two CTAs allow).
FORCE_STAGES: int | None = None  # tests and benchmarks: run the ping-pong forward with this many q buffers


def fwd_stages(schedule: str, group: int) -> int:
    if schedule != "pingpong":
        return 2
    return FORCE_STAGES or (1 if group >= 2 else 2)


# How sparse_fwd's two warpgroups share a tile (kernels_src/sparse_fwd/pingpong.py), per MMA: on wgmma each
# warpgroup runs its own rows and their QK products take turns (ping-pong); mma.sync has the lockstep kernel only.
# Measured on one 16K-query chunk at S = 64K (results/ab_sparse_fwd_pingpong_76681b9.log), lockstep -> ping-pong:
# (a) 2.79 -> 2.22 ms, (b) 5.36 -> 4.32, (c) 9.68 -> 8.76; the outputs are bit-identical.
FWD_SCHEDULE = {"sync": "lockstep", "wgmma": "pingpong"}
FORCE_SCHEDULE: str | None = None  # tests and benchmarks: run the wgmma forward with this schedule instead


def fwd_schedule(mma: str) -> str:
    return FORCE_SCHEDULE if FORCE_SCHEDULE and mma == "wgmma" else FWD_SCHEDULE[mma]


# The MMA each family runs on sm90a, by measurement ((b) S = 64K B = 2, kernels_src/sparse_fwd/NOTES.md): wgmma
# takes sparse_fwd from 26.4 to 23.1 ms and sparse_bwd from 67.4 to 57.0; the KL pass in ping-pong 4.40 -> 2.12 ms
# on a 16K-query chunk at (b), 6.70 -> 4.62 at (c), G = 16 (results/ab_sparse_kl_streamed_ab83e1c.log; mma.sync
# -> wgmma); select 20.07 -> 15.82 ms (results/ab_select_wgmma_eabdb10.log). Elsewhere every family runs mma.sync
# (Blackwell has no wgmma). Both kinds are built for sm90a, and the GPU tests check both.
SM90_MMA = {"sparse_fwd": "wgmma", "sparse_kl": "wgmma", "sparse_bwd": "wgmma", "sparse_bwd_proxy": "wgmma",
            "select": "wgmma", "block_scores": "wgmma"}
FORCE_MMA: str | None = None  # tests and benchmarks: run every family on this MMA instead ("sync" | "wgmma")


def family_mma(arch: str, op: str) -> str:
    """The MMA kind the kernel of family op (block_scores, select, sparse_fwd, sparse_kl, sparse_bwd,
    sparse_bwd_proxy) uses on arch."""
    if arch != "sm90a":
        return "sync"
    if FORCE_MMA:
        return FORCE_MMA
    return SM90_MMA[op]


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> str:
    from flash_msa_rt.loader import device_arch

    return device_arch(index)


def device_mma(device: torch.device, op: str) -> str:
    """family_mma of the device's arch for op (the arch cached per device); "sync" off CUDA (emulated kernels in
    CPU tests)."""
    if device.type != "cuda":
        return "sync"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return family_mma(_device_arch(index), op)


def per_group_tiles(main_tiles: int, group: int) -> int:
    """Tiles per item for kernels whose tile visits the G heads in turn (KL pass, proxy backward): about
    main_tiles // G, between 1 and 32."""
    return max(1, min(32, main_tiles // group))


COMBINE_LANE_ELEMENTS = 16  # kernels_src.sparse_combine.LANE_ELEMENTS
COMBINE_HEADS_PER_WARP: int | None = None  # A/B runs: 1 runs the one-head-per-warp combine (None: the widest)


def combine_heads(group: int, head_dim: int) -> int:
    """The combine's heads per warp: as many of the G heads as keep a lane at 16 elements (2 x 16-byte loads per
    slot), unless COMBINE_HEADS_PER_WARP says otherwise (kernels_src.sparse_combine.widest_heads)."""
    return COMBINE_HEADS_PER_WARP or max(1, min(group, 32 * COMBINE_LANE_ELEMENTS // head_dim))


def combine_config(dtype: str, head_dim: int, block_size: int, group: int) -> dict:
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group, "threads": 256,
            "heads_per_warp": combine_heads(group, head_dim)}


def combine_kl_config(block_size: int) -> dict:
    """The KL merge reads fp32 statistics only: one variant per block size (the key groups are kl_part's)."""
    return {"block_size": block_size, "threads": 256}


def tile_n_for(mma: str, block_size: int) -> int:
    """Keys per CTA of the kernels on 64-query tiles (KL pass, both backward kernels): the whole key block on wgmma
    (dK, dV or dk_p of 128 keys in registers; (b) S = 64K: sparse_bwd 53.5 -> 37.6 ms, sparse_bwd_proxy 31.9 ->
    19.5 against two CTAs of 64 keys), 64-key slices on mma.sync (128 keys spill there)."""
    return block_size if mma == "wgmma" else 64


# How the KL pass's two warpgroups share the work on wgmma: each runs its own tiles over the whole key block
# ("pingpong"), with the G + 1 head tiles resident and single-buffered at G <= 4 (kernels_src/sparse_kl/
# pingpong.py) or streamed through a ring of KL_STREAM_STAGES slots at G = 8, 16 (streamed.py); "lockstep": both
# warpgroups on one tile (wgmma.py), the only schedule of the mma.sync kernel.
KL_RESIDENT_GROUPS = (1, 2, 4)
KL_STREAM_STAGES = 4
FORCE_KL_SCHEDULE: str | None = None  # tests and benchmarks: "lockstep" runs the lockstep wgmma kernel instead


def kl_schedule(mma: str) -> str:
    return (FORCE_KL_SCHEDULE or "pingpong") if mma == "wgmma" else "lockstep"


def kl_config(dtype: str, head_dim: int, block_size: int, group: int, mma: str = "sync",
              schedule: str | None = None) -> dict:
    """The KL pass runs on the proxy backward's tiles (64 distinct queries x tile_n_for(mma) keys per CTA);
    schedule: kl_schedule(mma) unless given."""
    schedule = schedule or kl_schedule(mma)
    stages = 2
    if schedule == "pingpong":
        stages = 1 if group in KL_RESIDENT_GROUPS else KL_STREAM_STAGES
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group, "tile_m": KL_TILE,
            "tile_n": tile_n_for(mma, block_size), "threads": 256, "stages": stages, "mma": mma,
            "schedule": schedule}


def kl_part_groups(config: dict) -> int:
    """Key groups (A, T, L triples) per entry that the KL pass of this kl_config writes: one per warpgroup or
    mma.sync key half, one in ping-pong (a warpgroup holds all the block's keys of its rows)."""
    if config["schedule"] == "pingpong":
        return 1
    return kl_groups(config["block_size"], config["tile_n"])


def variants(dtype: str, head_dim: int, proxy_head_dim: int, block_size: int, group: int,
             arch: str = "sm90a") -> list[tuple[str, dict]]:
    """Every (op, config) one forward launches on arch."""
    return [("sparse_fwd", kernel_config(dtype, head_dim, block_size, group, family_mma(arch, "sparse_fwd"))),
            ("sparse_combine", combine_config(dtype, head_dim, block_size, group)),
            ("sparse_kl", kl_config(dtype, head_dim, block_size, group, family_mma(arch, "sparse_kl"))),
            ("sparse_combine_kl", combine_kl_config(block_size))] + list_kernel_configs(block_size)


def _plan_args(plan) -> dict:
    return dict(entry_query=plan.entry_query, entry_dest=plan.entry_dest, items=plan.items)


def _kl_args(q_proxy, k_proxy, q, k, plan, scale) -> dict:
    Hp = q_proxy.shape[2]
    return dict(q=q, k=k, q_proxy=q_proxy, k_proxy=k_proxy, scale=float(scale), hp_per_hk=Hp // k.shape[2],
                hp_per_hpk=Hp // k_proxy.shape[2], **_plan_args(plan))


def partials_budget(B: int, S: int, H: int, D: int) -> int:
    """Bytes one forward chunk's partials may hold: PARTIALS_BUDGET, or the backward's fp32 dq accumulator
    (4 * B * S * H * D bytes) where that is larger, since training needs that much later anyway. Fewer chunks
    cost less host work and fewer grid tails: (b) S = 64K B = 2 forward 66.9 ms in 18 chunks of 1 GiB, 59.3 in 9
    of 2 GiB, 56.9 in 5 of 4 GiB (benchmarks/profile_msa.py)."""
    return max(PARTIALS_BUDGET, 4 * B * S * H * D)


# A chunk may hold this fraction more than the budget, so that the queries split into equal chunks instead of
# full ones and a small tail: configuration (a) at B = 1, S = 16K would run a 640-query tail chunk (a plan, four
# launches and their grid tails) for 4 % over the budget, (b) at S = 64K 9 chunks where 8 take 5 % more.
CHUNK_SLACK = 1 / 8


def query_chunk(B: int, S: int, Hp: int, K: int, G: int, D: int, block_size: int,
                budget: int | None = None) -> int:
    """Queries per forward chunk, a multiple of block_size (at least one block): the partial buffers (o_part in
    2 bytes; lse_part and the KL pass's (A, T, L) triples in fp32) of one chunk stay within budget bytes (default
    partials_budget) plus CHUNK_SLACK, and the chunks are as equal as whole blocks allow."""
    per_query = B * Hp * K * (G * D * 2 + 4 * (G + 3 * kl_groups(block_size)))
    return equal_chunk(S, block_size, per_query, budget or partials_budget(B, S, Hp * G, D))


def heads_per_chunk(per_head: int, Hp: int, Hk: int, Hpk: int, budget: int, slack: float = 0.0) -> int:
    """Proxy heads per chunk when one head's buffers take per_head bytes: the most that fit budget (plus the
    fraction slack of it), at least 1. The count divides Hp and is a multiple or a divisor of each
    proxy-heads-per-KV-head ratio, so a chunk's main, KV and proxy-key heads are contiguous head ranges
    (chunk_heads)."""
    fits = [c for c in range(Hp, 0, -1) if Hp % c == 0
            and all(c % r == 0 or r % c == 0 for r in (Hp // Hk, Hp // Hpk))]
    return next((c for c in fits if c * per_head <= budget * (1 + slack)), 1)


def chunk_heads(p0: int, c: int, per: int) -> tuple[slice, int]:
    """(heads, proxy heads per head inside the chunk) of the heads shared by `per` proxy heads each (KV heads,
    proxy key heads) that proxy heads [p0, p0 + c) use (c as heads_per_chunk gives it)."""
    if c % per == 0:
        return slice(p0 // per, (p0 + c) // per), per
    return slice(p0 // per, p0 // per + 1), c


@dataclasses.dataclass(frozen=True)
class HeadChunk:
    """Proxy heads `proxy` of a chunk and the heads they use: main heads (G each), KV heads (per_kv proxy heads
    each inside the chunk) and proxy key heads (per_pk each). A chunk of every head (small problems, where the
    host's work is the op's time) uses the tensors themselves, no views."""

    p0: int
    proxy: slice
    main: slice
    kv: slice
    per_kv: int
    proxy_key: slice
    per_pk: int
    every: bool

    def view(self, t: torch.Tensor, dim: int, part: str) -> torch.Tensor:
        """t sliced along dim to this chunk's heads of kind part ("proxy", "main", "kv" or "proxy_key")."""
        return t if self.every else t[(slice(None),) * dim + (getattr(self, part),)]


def head_chunks(Hp: int, Hk: int, Hpk: int, G: int, c: int) -> list[HeadChunk]:
    """The chunks of c proxy heads (c as heads_per_chunk gives it) in order."""
    chunks = []
    for p0 in range(0, Hp, c):
        kv, per_kv = chunk_heads(p0, c, Hp // Hk)
        pk, per_pk = chunk_heads(p0, c, Hp // Hpk)
        chunks.append(HeadChunk(p0, slice(p0, p0 + c), slice(p0 * G, (p0 + c) * G), kv, per_kv, pk, per_pk, c == Hp))
    return chunks


# How the forward cuts a problem whose partials exceed the budget: "heads" first (chunks of proxy heads over every
# query, then queries too where one head's partials do not fit), or "queries" (every head, chunks of queries).
# Chunks of heads keep each reverse list whole, so its items are full: a query chunk of 1 / n of the sequence cuts
# every list into n shorter ones, each ending in a partial item.
FORWARD_CHUNKS = "heads"


def forward_chunks(B: int, S: int, Hp: int, Hk: int, Hpk: int, K: int, G: int, D: int, block_size: int,
                   budget: int | None = None) -> tuple[int, int]:
    """(proxy heads, queries) per forward chunk: the partial buffers of one chunk (o_part in 2 bytes, lse_part and
    the KL pass's (A, T, L) triples in fp32, per entry) fit budget (default partials_budget) plus CHUNK_SLACK."""
    budget = budget or partials_budget(B, S, Hp * G, D)
    per_entry = G * D * 2 + 4 * (G + 3 * kl_groups(block_size))
    # CHUNK_SLACK as for queries: (a) at B = 1, S = 16K holds 1.14 GB of partials against a 1 GiB budget, and two
    # chunks of two heads doubled its host-bound forward's launches (results/bench_msa_batch1_1989e46.log).
    c = Hp
    if FORWARD_CHUNKS == "heads":
        c = heads_per_chunk(B * S * K * per_entry, Hp, Hk, Hpk, budget, CHUNK_SLACK)
    return c, equal_chunk(S, block_size, B * c * K * per_entry, budget)


def equal_chunk(S: int, block_size: int, per_query: int, budget: int) -> int:
    """Queries per chunk, whole blocks, when a query costs per_query bytes: at most budget (plus CHUNK_SLACK) per
    chunk, and the chunks as equal as whole blocks allow."""
    fit = max(1, budget // per_query // block_size)  # blocks per chunk
    cap = fit + int(fit * CHUNK_SLACK)
    blocks = max(1, -(-S // block_size))
    chunks = -(-blocks // cap)
    return -(-blocks // chunks) * block_size


def msa_forward_cuda(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale):
    """(out (B, S, H, D), lse (B, H, S), lse_proxy (B, Hp, S), kl_rows (B, Hp, S)) on a CUDA device.

    The caller has validated shapes and made every tensor 16-byte aligned with a unit-stride head dim.
    Queries run in chunks whose per-slot partial outputs fit partials_budget: a row's K slots all belong to its
    chunk, so each chunk is planned, computed, combined and its KL taken on its own; extra memory is the plan
    (O(B*Hp*S*K) int32) plus one chunk's partials, whatever S.
    q_proxy = k_proxy = None: the main attention alone over block_indices (B, Hp, S, K), G = H / Hp heads per
    index head (block_sparse_attention); lse_proxy and kl_rows are then None.
    """
    B, S, H, D = q.shape
    Hp, K = block_indices.shape[1], block_indices.shape[3]
    G = H // Hp
    proxy = q_proxy is not None
    dt = DTYPES[q.dtype]
    dev = q.device
    fwd = get_kernel("sparse_fwd", kernel_config(dt, D, block_size, G, device_mma(dev, "sparse_fwd")), dev)
    combine = get_kernel("sparse_combine", combine_config(dt, D, block_size, G), dev)
    if proxy:
        kl_cfg = kl_config(dt, D, block_size, G, device_mma(dev, "sparse_kl"))
        kl = get_kernel("sparse_kl", kl_cfg, dev)
        combine_kl = get_kernel("sparse_combine_kl", combine_kl_config(block_size), dev)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=dev)
    lse_proxy = torch.empty((B, Hp, S), dtype=torch.float32, device=dev) if proxy else None
    # Every (b, p, i) row lies in one chunk, whose KL merge writes it: no fill needed.
    kl_rows = torch.empty((B, Hp, S), dtype=torch.float32, device=dev) if proxy else None
    if out.numel() == 0:
        return out, lse, lse_proxy, kl_rows
    Hk, Hpk = k.shape[2], (k_proxy.shape[2] if proxy else Hp)
    c, chunk = forward_chunks(B, S, Hp, Hk, Hpk, K, G, D, block_size)
    # Every chunk's plan and the KL pass's recut of it from one sort (chunk_plans: the host's work per chunk is
    # then its views and launches); planned before the partial buffers exist, so the sort's temporaries do not
    # add to the peak.
    cuts = ((TILE_M // G, TILES_PER_ITEM),) + (((KL_TILE, per_group_tiles(KL_MAIN_TILES_PER_ITEM, G)),) if proxy
                                               else ())
    plans = chunk_plans(block_indices, block_size, G, c, chunk, cuts, FORWARD_ITEM_ORDER)
    E_max = B * c * min(chunk, S) * K
    o_buf = torch.empty((E_max, G, D), dtype=q.dtype, device=dev)
    lse_buf = torch.empty((E_max, G), dtype=torch.float32, device=dev)
    if proxy:
        kl_buf = torch.empty((E_max, 3 * kl_part_groups(kl_cfg)), dtype=torch.float32, device=dev)
    for hc in head_chunks(Hp, Hk, Hpk, G, c):
        # A chunk is the same problem on head-sliced views (strided: the kernels take any strides).
        q_c, k_c, v_c, lse_c = hc.view(q, 2, "main"), hc.view(k, 2, "kv"), hc.view(v, 2, "kv"), hc.view(lse, 1, "main")
        if proxy:
            kl_args = dict(q=q_c, k=k_c, q_proxy=hc.view(q_proxy, 2, "proxy"),
                           k_proxy=hc.view(k_proxy, 2, "proxy_key"), scale=float(scale), hp_per_hk=hc.per_kv,
                           hp_per_hpk=hc.per_pk)
        for s0 in range(0, S, chunk):
            s1 = min(S, s0 + chunk)
            sel = block_indices[:, hc.proxy, s0:s1]  # a strided view: both merges take any strides
            plan, *kl_plan = plans[(hc.p0, s0)]
            o_part, lse_part = o_buf[:plan.E], lse_buf[:plan.E]
            fwd(q=q_c, k=k_c, v=v_c, o_part=o_part, lse_part=lse_part, scale=float(scale), hp=c,
                hp_per_hk=hc.per_kv, **_plan_args(plan))
            combine(block_indices=sel, o_part=o_part, lse_part=lse_part, out=out[:, s0:s1, hc.main],
                    lse=lse_c[:, :, s0:s1], query_offset=s0)
            if not proxy:
                continue
            kl_part = kl_buf[:kl_plan[0].E]
            kl(lse=lse_c, kl_part=kl_part, **kl_args, **_plan_args(kl_plan[0]))
            combine_kl(block_indices=sel, kl_part=kl_part, lse_proxy=lse_proxy[:, hc.proxy, s0:s1],
                       kl_rows=kl_rows[:, hc.proxy, s0:s1], query_offset=s0)
    return out, lse, lse_proxy, kl_rows


def _kl_chunk(kl, combine_kl, q_proxy, k_proxy, q, k, lse, sel, s0, kl_buf, scale, lse_proxy, kl_rows, kl_plan):
    """The KL pass over queries [s0, s0 + sel.shape[2]) on kl_plan (the KL pass's tiles) given the final main lse:
    writes lse_proxy and kl_rows (B, Hp, S) there."""
    kl_part = kl_buf[:kl_plan.E]
    kl(lse=lse, kl_part=kl_part, **_kl_args(q_proxy, k_proxy, q, k, kl_plan, scale))
    s1 = s0 + sel.shape[2]
    combine_kl(block_indices=sel, kl_part=kl_part, lse_proxy=lse_proxy[:, :, s0:s1], kl_rows=kl_rows[:, :, s0:s1],
               query_offset=s0)


def msa_kl_cuda(q_proxy, k_proxy, q, k, lse, block_indices, block_size, scale):
    """(lse_proxy (B, Hp, S), kl_rows (B, Hp, S)) of a selection, given the main attention's final lse (B, H, S):
    the KL pass alone, for a main attention computed elsewhere (warmup mode: cuDNN's dense attention). Queries run
    in chunks whose (A, T, L) partials fit KL_PARTIALS_BUDGET."""
    B, S, H, D = q.shape
    Hp, K = q_proxy.shape[2], block_indices.shape[3]
    G = H // Hp
    dev = q.device
    kl_cfg = kl_config(DTYPES[q.dtype], D, block_size, G, device_mma(dev, "sparse_kl"))
    kl = get_kernel("sparse_kl", kl_cfg, dev)
    combine_kl = get_kernel("sparse_combine_kl", combine_kl_config(block_size), dev)
    lse_proxy = torch.empty((B, Hp, S), dtype=torch.float32, device=dev)
    kl_rows = torch.zeros((B, Hp, S), dtype=torch.float32, device=dev)
    if S == 0 or B == 0:
        return lse_proxy, kl_rows
    groups = kl_part_groups(kl_cfg)
    per_query = B * Hp * K * 4 * 3 * groups
    chunk = max(block_size, KL_PARTIALS_BUDGET // per_query // block_size * block_size)
    kl_buf = torch.empty((B * Hp * min(chunk, S) * K, 3 * groups), dtype=torch.float32, device=dev)
    lse = lse.contiguous()
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        sel = block_indices[:, :, s0:s1].contiguous()
        kl_plan = sparse_plan(sel, block_size, s1 - s0, G, KL_TILE, per_group_tiles(KL_MAIN_TILES_PER_ITEM, G),
                              query_offset=s0)
        _kl_chunk(kl, combine_kl, q_proxy, k_proxy, q, k, lse, sel, s0, kl_buf, scale, lse_proxy, kl_rows, kl_plan)
    return lse_proxy, kl_rows
