"""The sparse forward's launcher: MSA main attention + proxy lse + KL on the GPU, KV-outer.

Steps, all on the device with no host synchronisation:
  0. the problem is cut into chunks (of heads, then queries) whose partial buffers fit the budget; per chunk:
  1. sparse_plan: the reverse index (key block -> the queries that chose it), cut into bounded work items (every
     chunk's at once: chunk_plans);
  2. sparse_fwd kernel: per (entry, head) the one-block partial output and its lse;
  3. sparse_combine kernel: logsumexp merge of each row's K slots -> out, lse;
  4. sparse_kl kernel (its own plan: tiles of 64 distinct queries): with the final lse, each entry's (A, T, L)
     shares of the KL and of the proxy lse per key group;
  5. sparse_combine_kl kernel: lse_proxy and kl_rows (KL = ln 2 * sum A + lse_proxy * sum T; its torch statement
     is partials.combine_kl_lse).
Internal layout (B, S, heads, D); the public API validates user input and routes here through dispatch.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from flash_msa_rt.errors import FlashMsaError
from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.ops.partials import kl_groups
from flash_msa_rt.ops.sparse_plan import chunk_plans, list_kernel_configs, lists_on_device, sparse_plan
from flash_msa_rt.tuning import sparse_fwd as tuning_fwd
from flash_msa_rt.tuning.problem import Problem
from flash_msa_rt.tuning.sparse_fwd import SparseFwdTuning

DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}  # f64: the CPU tests' emulated kernels
TILE_M = 128  # rows per forward tile: 128 // G queries x G heads
KL_TILE = 64  # distinct queries per KL tile; the tile visits the G heads one after another


def kernel_config(dtype: str, head_dim: int, block_size: int, group: int, t: SparseFwdTuning) -> dict:
    """The forward's variant for a problem under the choice t (tuning.sparse_fwd)."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group, "tile_m": TILE_M,
            "threads": 256, "stages": t.stages, "mma": t.mma, "schedule": t.schedule}


def combine_config(dtype: str, head_dim: int, block_size: int, group: int, t: SparseFwdTuning,
                   sinks: bool = False) -> dict:
    """The combine's variant; sinks: the one that also scales out by each row's kept mass (scale_rows 1, built at
    the widest heads per warp only)."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group, "threads": 256,
            "heads_per_warp": t.combine_heads, "scale_rows": int(sinks)}


def combine_kl_config(block_size: int) -> dict:
    """The KL merge reads fp32 statistics only: one variant per block size (the key groups are kl_part's)."""
    return {"block_size": block_size, "threads": 256}


def kl_config(dtype: str, head_dim: int, block_size: int, group: int, t: SparseFwdTuning) -> dict:
    """The KL pass runs on the proxy backward's tiles (64 distinct queries x t.kl_tile_n keys per CTA)."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group, "tile_m": KL_TILE,
            "tile_n": t.kl_tile_n, "threads": 256, "stages": t.kl_stages, "mma": t.kl_mma, "schedule": t.kl_schedule,
            "kl_value": 1}


def lse_config(dtype: str, head_dim: int, block_size: int) -> dict:
    """The proxy lse alone (kernels_src/sparse_kl/lse.py): the ping-pong KL pass's tiles with the proxy head only,
    one variant for every G (group 1), on any G's KL plan."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": 1, "tile_m": KL_TILE,
            "tile_n": block_size, "threads": 256, "stages": 1, "mma": "wgmma", "schedule": "pingpong", "kl_value": 0}


def kl_part_groups(config: dict) -> int:
    """Key groups (A, T, L triples) per entry that the KL pass of this kl_config writes: one per warpgroup or
    mma.sync key half, one in ping-pong (a warpgroup holds all the block's keys of its rows)."""
    if config["schedule"] == "pingpong":
        return 1
    return kl_groups(config["block_size"], config["tile_n"])


def choice(arch: str, group: int, head_dim: int = 128, block_size: int = 128, B: int = 0, S: int = 0,
           H: int = 0) -> SparseFwdTuning:
    """tuning.sparse_fwd's choice for a forward of these sizes on arch (under the overrides in effect)."""
    return tuning_fwd.choose(arch, Problem(group=group, head_dim=head_dim, block_size=block_size, batch=B,
                                           seqlen=S, heads=H))


def variants(dtype: str, head_dim: int, proxy_head_dim: int, block_size: int, group: int,
             arch: str = "sm90a", sinks: bool = False) -> list[tuple[str, dict]]:
    """Every (op, config) one forward launches on arch (sinks: a forward with attention sinks)."""
    t = choice(arch, group, head_dim, block_size)
    return [("sparse_fwd", kernel_config(dtype, head_dim, block_size, group, t)),
            ("sparse_combine", combine_config(dtype, head_dim, block_size, group, t, sinks)),
            ("sparse_kl", kl_config(dtype, head_dim, block_size, group, t)),
            ("sparse_combine_kl", combine_kl_config(block_size))] + list_kernel_configs(block_size, arch=arch)


def _plan_args(plan) -> dict:
    return dict(entry_query=plan.entry_query, entry_dest=plan.entry_dest, items=plan.items)


def _kl_args(q_proxy, k_proxy, q, k, plan, scale, proxy_scale=None) -> dict:
    """The KL pass's arguments: scale the main scores' (tau), proxy_scale the proxy scores' (None: scale)."""
    Hp = q_proxy.shape[2]
    return dict(q=q, k=k, q_proxy=q_proxy, k_proxy=k_proxy, scale=float(scale),
                proxy_scale=_proxy_scale(scale, proxy_scale), hp_per_hk=Hp // k.shape[2],
                hp_per_hpk=Hp // k_proxy.shape[2], **_plan_args(plan))


def _proxy_scale(scale, proxy_scale) -> float:
    """The proxy scores' scale as the kernels take it (None: the main scale)."""
    return float(scale if proxy_scale is None else proxy_scale)


# A chunk may hold this fraction more than the budget, so that the queries split into equal chunks instead of
# full ones and a small tail: configuration (a) at B = 1, S = 16K would run a 640-query tail chunk (a plan, four
# launches and their grid tails) for 4 % over the budget, (b) at S = 64K 9 chunks where 8 take 5 % more.
CHUNK_SLACK = 1 / 8


def query_chunk(B: int, S: int, Hp: int, K: int, G: int, D: int, block_size: int, budget: int) -> int:
    """Queries per forward chunk, a multiple of block_size (at least one block): the partial buffers (o_part in
    2 bytes; lse_part and the KL pass's (A, T, L) triples in fp32) of one chunk stay within budget bytes (the
    choice's partials_budget) plus CHUNK_SLACK, and the chunks are as equal as whole blocks allow."""
    per_query = B * Hp * K * (G * D * 2 + 4 * (G + 3 * kl_groups(block_size)))
    return equal_chunk(S, block_size, per_query, budget)


def heads_per_chunk(per_head: int, Hp: int, Hk: int, Hpk: int, budget: int, slack: float = 0.0) -> int:
    """Proxy heads per chunk when one head's buffers take per_head bytes: the most that fit budget (plus the
    fraction slack of it), at least 1. The count divides Hp and is a multiple or a divisor of each
    proxy-heads-per-KV-head ratio, so a chunk's main, KV and proxy-key heads are contiguous head ranges
    (chunk_heads)."""
    return next((c for c in chunk_head_counts(Hp, Hk, Hpk) if c * per_head <= budget * (1 + slack)), 1)


def chunk_head_counts(Hp: int, Hk: int, Hpk: int) -> list[int]:
    """The proxy head counts a chunk may have, most first: divisors of Hp that are a multiple or a divisor of each
    proxy-heads-per-KV-head ratio, so a chunk's main, KV and proxy-key heads are contiguous head ranges
    (chunk_heads)."""
    return [c for c in range(Hp, 0, -1) if Hp % c == 0 and all(c % r == 0 or r % c == 0 for r in (Hp // Hk, Hp // Hpk))]


def sorted_heads(block_indices: torch.Tensor, block_size: int, G: int, queries: int, Hk: int, Hpk: int) -> int:
    """Proxy heads per chunk of a pass over every head (the KL pass alone): all of them where the plan kernels sort
    the whole selection at once, else the most whose head group they sort (chunk_plans then sorts one group at a
    time), else all (the torch sort). (b) S = 1M, B = 1: the deferred backward's proxy lse pass sorts one head at a
    time instead of 89M-entry batches of the torch sort."""
    Hp = block_indices.shape[1]
    if lists_on_device(block_indices, block_size, G, Hp, queries) is not None:
        return Hp
    return next((c for c in chunk_head_counts(Hp, Hk, Hpk)[1:]
                 if lists_on_device(block_indices[:, :c], block_size, G, c, queries) is not None), Hp)


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


def forward_chunks(B: int, S: int, Hp: int, Hk: int, Hpk: int, K: int, G: int, D: int, block_size: int,
                   budget: int, chunks: str = "heads") -> tuple[int, int]:
    """(proxy heads, queries) per forward chunk: the partial buffers of one chunk (o_part in 2 bytes, lse_part and
    the KL pass's (A, T, L) triples in fp32, per entry) fit budget (the choice's partials_budget) plus
    CHUNK_SLACK; chunks (the choice's): "heads" cuts the heads first (chunks of proxy heads over every query,
    then queries too where one head's partials do not fit), "queries" the queries only."""
    per_entry = G * D * 2 + 4 * (G + 3 * kl_groups(block_size))
    # CHUNK_SLACK as for queries: (a) at B = 1, S = 16K holds 1.14 GB of partials against a 1 GiB budget, and two
    # chunks of two heads doubled its host-bound forward's launches.
    c = Hp
    if chunks == "heads":
        c = heads_per_chunk(B * S * K * per_entry, Hp, Hk, Hpk, budget, CHUNK_SLACK)
    return c, equal_chunk(S, block_size, B * c * K * per_entry, budget)


def rows(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """t[start:stop] along dim; t itself where that is all of it: a host-bound problem is one chunk, and every view
    is one more torch op of host time (benchmarks/host_api_cpu.py counts them)."""
    return t if start == 0 and stop == t.shape[dim] else t.narrow(dim, start, stop - start)


def equal_chunk(S: int, block_size: int, per_query: int, budget: int) -> int:
    """Queries per chunk, whole blocks, when a query costs per_query bytes: at most budget (plus CHUNK_SLACK) per
    chunk, and the chunks as equal as whole blocks allow."""
    fit = max(1, budget // per_query // block_size)  # blocks per chunk
    cap = fit + int(fit * CHUNK_SLACK)
    blocks = max(1, -(-S // block_size))
    chunks = -(-blocks // cap)
    return -(-blocks // chunks) * block_size


def msa_forward_cuda(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, arch: str | None = None,
                     keep_lists: bool = False, proxy_scale=None, sinks=None):
    """(out (B, S, H, D), lse (B, H, S), lse_proxy (B, Hp, S), kl_rows (B, Hp, S)) on a CUDA device.

    k, v, k_proxy may hold Sk >= S keys: query row i then sits at key position Sk - S + i (bottom-right causal
    alignment; a chunk of a sequence against its whole prefix) and block_indices holds absolute key blocks.

    The caller has validated shapes and made every tensor 16-byte aligned with a unit-stride head dim.
    Queries run in chunks whose per-slot partial outputs fit the choice's partials_budget (tuning.sparse_fwd, for
    arch: the device's unless given): a row's K slots all belong to its
    chunk, so each chunk is planned, computed, combined and its KL taken on its own; extra memory is the plan
    (O(B*Hp*S*K) int32) plus one chunk's partials, whatever S.
    q_proxy = k_proxy = None: the main attention alone over block_indices (B, Hp, S, K), G = H / Hp heads per
    index head (block_sparse_attention); lse_proxy and kl_rows are then None.
    keep_lists: the plan's sorted lists stay on block_indices for the MSA backward's plan (chunk_plans'), which
    takes them instead of sorting the selection again.
    proxy_scale: the proxy scores' scale in the KL pass (None: scale, the main scores').
    sinks: None or float32 (H,) sink logits: the combine scales out by each row's kept mass 1 - p_sink; lse (and so
    the KL pass) stays sink-free (flash_msa_rt.ops.sinks).
    """
    B, S, H, D = q.shape
    Hp, K = block_indices.shape[1], block_indices.shape[3]
    G = H // Hp
    proxy = q_proxy is not None
    dt = DTYPES[q.dtype]
    dev = q.device
    arch = arch or arch_of(dev)
    t = choice(arch, G, D, block_size, B, S, H)
    fwd = get_kernel("sparse_fwd", kernel_config(dt, D, block_size, G, t), dev)
    combine = get_kernel("sparse_combine", combine_config(dt, D, block_size, G, t, sinks is not None), dev)
    sink_args = {} if sinks is None else {"sinks": sinks.detach().to(torch.float32).contiguous()}
    if proxy:
        kl_cfg = kl_config(dt, D, block_size, G, t)
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
    key_offset = k.shape[1] - S  # the kernels take it from the shapes; the plans and the merges' live rule here
    c, chunk = forward_chunks(B, S, Hp, Hk, Hpk, K, G, D, block_size, t.partials_budget, t.chunks)
    # Every chunk's plan and the KL pass's recut of it from one sort (chunk_plans: the host's work per chunk is
    # then its views and launches); planned before the partial buffers exist, so the sort's temporaries do not
    # add to the peak.
    cuts = ((TILE_M // G, t.tiles_per_item),) + (((KL_TILE, t.kl_tiles_per_item),) if proxy else ())
    plans = chunk_plans(block_indices, block_size, G, c, chunk, cuts, t.item_order, arch=arch, key_offset=key_offset,
                        keep_lists=keep_lists, bin_queries=t.bin_queries)
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
                           k_proxy=hc.view(k_proxy, 2, "proxy_key"), scale=float(scale),
                           proxy_scale=_proxy_scale(scale, proxy_scale), hp_per_hk=hc.per_kv, hp_per_hpk=hc.per_pk)
        for s0 in range(0, S, chunk):
            s1 = min(S, s0 + chunk)
            sel = rows(hc.view(block_indices, 1, "proxy"), 2, s0, s1)  # strided views: both merges take any strides
            plan, *kl_plan = plans[(hc.p0, s0)]
            o_part, lse_part = rows(o_buf, 0, 0, plan.E), rows(lse_buf, 0, 0, plan.E)
            fwd(q=q_c, k=k_c, v=v_c, o_part=o_part, lse_part=lse_part, scale=float(scale), hp=c,
                hp_per_hk=hc.per_kv, **_plan_args(plan))
            combine(block_indices=sel, o_part=o_part, lse_part=lse_part, out=rows(hc.view(out, 2, "main"), 1, s0, s1),
                    lse=rows(lse_c, 2, s0, s1), query_offset=key_offset + s0,
                    **{n: hc.view(x, 0, "main") for n, x in sink_args.items()})
            if not proxy:
                continue
            kl_part = rows(kl_buf, 0, 0, kl_plan[0].E)
            kl(lse=lse_c, kl_part=kl_part, **kl_args, **_plan_args(kl_plan[0]))
            combine_kl(block_indices=sel, kl_part=kl_part, lse_proxy=rows(hc.view(lse_proxy, 1, "proxy"), 2, s0, s1),
                       kl_rows=rows(hc.view(kl_rows, 1, "proxy"), 2, s0, s1), query_offset=key_offset + s0)
    return out, lse, lse_proxy, kl_rows


def _kl_chunk(kl, combine_kl, q_proxy, k_proxy, q, k, lse, sel, s0, kl_buf, scale, lse_proxy, kl_rows, kl_plan,
              lse_only: bool = False, proxy_scale=None):
    """The KL pass over queries [s0, s0 + sel.shape[2]) on kl_plan (the KL pass's tiles) given the final main lse:
    writes lse_proxy and kl_rows (B, Hp, S) there (keys longer than queries: kl_plan's key_offset). lse_only: kl is
    the proxy lse kernel (lse_config), kl_rows come out 0. proxy_scale: the proxy scores' (None: scale)."""
    kl_part = rows(kl_buf, 0, 0, kl_plan.E)
    if lse_only:
        kl(q_proxy=q_proxy, k_proxy=k_proxy, kl_part=kl_part, proxy_scale=_proxy_scale(scale, proxy_scale),
           hp_per_hpk=q_proxy.shape[2] // k_proxy.shape[2], **_plan_args(kl_plan))
    else:
        kl(lse=lse, kl_part=kl_part, **_kl_args(q_proxy, k_proxy, q, k, kl_plan, scale, proxy_scale))
    s1 = s0 + sel.shape[2]
    combine_kl(block_indices=sel, kl_part=kl_part, lse_proxy=rows(lse_proxy, 2, s0, s1),
               kl_rows=rows(kl_rows, 2, s0, s1), query_offset=kl_plan.key_offset + s0)


@functools.lru_cache(maxsize=None)
def lse_only_runs(dtype: str, head_dim: int, proxy_head_dim: int, block_size: int, group: int, arch: str) -> bool:
    """Whether msa_kl_cuda(with_kl=False) runs the proxy lse kernel at the proxy's own head dim (no zero-padded
    copy of the proxy; the KL pass, which reads the main heads too, takes it padded to D)."""
    t = choice(arch, group, head_dim, block_size)
    return t.kl_schedule == "pingpong" and lse_built(dtype, proxy_head_dim, block_size, arch)


def lse_built(dtype: str, head_dim: int, block_size: int, arch: str) -> bool:
    """Whether the proxy lse kernel (lse_config) is in the artifacts for arch (looked up once per variant)."""
    from flash_msa_rt.loader import find_variant

    try:
        find_variant("sparse_kl", lse_config(dtype, head_dim, block_size), arch)
    except FlashMsaError:
        return False
    return True


def msa_kl_cuda(q_proxy, k_proxy, q, k, lse, block_indices, block_size, scale, arch: str | None = None,
                with_kl: bool = True, proxy_scale=None):
    """(lse_proxy (B, Hp, S), kl_rows (B, Hp, S)) of a selection, given the main attention's final lse (B, H, S):
    the KL pass alone, for a main attention computed elsewhere (warmup mode: cuDNN's dense attention) or for the
    backward of a forward that ran none. Queries run in chunks whose (A, T, L) partials fit the choice's
    kl_partials_budget. k, k_proxy may be longer than the queries (msa_forward_cuda's alignment).
    with_kl False: lse_proxy is what is asked for; where the proxy lse kernel is built it runs instead of the KL
    pass (the same lse_proxy, bit for bit) and kl_rows are zeros. proxy_scale: the proxy scores' (None: scale)."""
    B, S, H, D = q.shape
    Hp, K = q_proxy.shape[2], block_indices.shape[3]
    G = H // Hp
    dev = q.device
    arch = arch or arch_of(dev)
    t = choice(arch, G, D, block_size, B, S, H)
    kl_cfg = kl_config(DTYPES[q.dtype], D, block_size, G, t)
    # The proxy lse kernel reads the ping-pong KL pass's plan (tiles of 64 distinct queries, the same entries) and
    # the proxy alone, at its own head dim (lse_only_runs: the caller then passes the proxy unpadded).
    dp = q_proxy.shape[3]
    lse_only = not with_kl and kl_cfg["schedule"] == "pingpong" and lse_built(DTYPES[q.dtype], dp, block_size, arch)
    kl = get_kernel("sparse_kl", lse_config(DTYPES[q.dtype], dp, block_size) if lse_only else kl_cfg, dev)
    combine_kl = get_kernel("sparse_combine_kl", combine_kl_config(block_size), dev)
    lse_proxy = torch.empty((B, Hp, S), dtype=torch.float32, device=dev)
    kl_rows = torch.zeros((B, Hp, S), dtype=torch.float32, device=dev)
    if S == 0 or B == 0:
        return lse_proxy, kl_rows
    groups = kl_part_groups(kl_cfg)
    per_query = B * Hp * K * 4 * 3 * groups
    chunk = max(block_size, t.kl_partials_budget // per_query // block_size * block_size)
    lse = lse.contiguous()
    key_offset = k.shape[1] - S
    # A selection tensor (kl_value "deferred": the backward's KL pass): every chunk's plan from one chunk_plans, on the
    # plan kernels as the forward's (a sparse_plan per chunk is the torch sort, ~35 torch ops). Warmup's
    # AllCausalBlocks makes its rows per chunk instead (the whole selection is O(S^2 / Bs)).
    plans, c = None, Hp
    if isinstance(block_indices, torch.Tensor):
        if not key_offset:
            c = sorted_heads(block_indices, block_size, G, chunk, k.shape[2], k_proxy.shape[2])
        plans = chunk_plans(block_indices, block_size, G, c, chunk, ((KL_TILE, t.kl_tiles_per_item),), t.item_order,
                            arch=arch, key_offset=key_offset, keep_lists=True, take_lists=True,
                            bin_queries=t.bin_queries)
    kl_buf = torch.empty((B * c * min(chunk, S) * K, 3 * groups), dtype=torch.float32, device=dev)
    for hc in head_chunks(Hp, k.shape[2], k_proxy.shape[2], G, c):
        # a chunk of heads is the same problem on head-sliced views (the kernels and merges take any strides)
        views = dict(q_proxy=hc.view(q_proxy, 2, "proxy"), k_proxy=hc.view(k_proxy, 2, "proxy_key"),
                     q=hc.view(q, 2, "main"), k=hc.view(k, 2, "kv"), lse=hc.view(lse, 1, "main"),
                     lse_proxy=hc.view(lse_proxy, 1, "proxy"), kl_rows=hc.view(kl_rows, 1, "proxy"))
        for s0 in range(0, S, chunk):
            s1 = min(S, s0 + chunk)
            if plans is not None:
                sel, (kl_plan,) = rows(hc.view(block_indices, 1, "proxy"), 2, s0, s1), plans[(hc.p0, s0)]
            else:
                sel = block_indices[:, :, s0:s1].contiguous()
                kl_plan = sparse_plan(sel, block_size, s1 - s0, G, KL_TILE, t.kl_tiles_per_item, query_offset=s0,
                                      key_offset=key_offset)
            _kl_chunk(kl, combine_kl, sel=sel, s0=s0, kl_buf=kl_buf, scale=scale, kl_plan=kl_plan, lse_only=lse_only,
                      proxy_scale=proxy_scale, **views)
    if lse_only:  # lse_proxy times a T of 0: NaN where lse_proxy is not finite
        kl_rows.zero_()
    return lse_proxy, kl_rows
