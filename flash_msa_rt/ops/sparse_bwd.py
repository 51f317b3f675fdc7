"""The sparse backward's launcher: main dq, dk, dv and proxy dq, dk on the GPU, KV-outer, no host sync.

  1. delta = rowsum(dO * O) in fp32 (bwd_delta kernel: dO and O read once);
  2. sparse_bwd kernel over a plan of 64-row tiles: dq, dk, dv into fp32 accumulators (atomics);
  3. sparse_bwd_proxy kernel over a plan of 64 distinct queries per tile: dq_proxy, dk_proxy from (pi - tau) times
     the upstream gradient of kl_rows, read from the device;
  4. the accumulators cast to the input dtypes.
With both gradients on wgmma, steps 2 and 3 run per chunk of proxy heads: sparse_bwd also writes each plan entry's
tau (the mean of its G heads' P, which it has anyway), and the proxy kernel reads it ("tau" heads) instead of
recomputing the G main score tiles; a chunk's tau rows fit the choice's tau_budget (tuning.sparse_bwd), and its
accumulators, which cover its heads only, are cast (step 4) when the chunks that add into them are done
(_ChunkGradients: the fp32 held at once is a chunk's, not every gradient's). Otherwise the proxy kernel recomputes
tau (resident or stepped heads; proxy_backward_cuda, which warmup mode also runs on its own).
Internal layout (B, S, heads, D). Atomics make the summation order vary run to run (not bitwise deterministic);
under torch.use_deterministic_algorithms(True) the tau path runs its deterministic variants instead, which store
partial rows that sparse_bwd_sums adds up in a fixed order (missing gradients then count as zeros).
"""

from __future__ import annotations

import math

import torch

from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops import sparse_bwd_sums, sparse_fwd
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.ops.grad_cast import cast_into, cast_like
from flash_msa_rt.ops.sparse_plan import chunk_plans, list_kernel_configs, recut, sparse_plan
from flash_msa_rt.tuning import sparse_bwd as tuning_bwd
from flash_msa_rt.tuning.head_dim import gather_stages
from flash_msa_rt.tuning.problem import Problem
from flash_msa_rt.tuning.sparse_bwd import (PRODUCER_GROUPS, PRODUCER_THREADS, TILE_M, SparseBwdTuning, keys_per_cta,
                                            per_group_tiles)


def choice(arch: str, group: int, head_dim: int = 128, block_size: int = 128, B: int = 0, S: int = 0,
           H: int = 0) -> SparseBwdTuning:
    """tuning.sparse_bwd's choice for a backward of these sizes on arch (under the overrides in effect)."""
    return tuning_bwd.choose(arch, Problem(group=group, head_dim=head_dim, block_size=block_size, batch=B,
                                           seqlen=S, heads=H))


def tile_config(dtype: str, head_dim: int, block_size: int, group: int, mma: str) -> dict:
    """The tiles of either backward kernel: a key block split over block_size // tile_n CTAs."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group, "tile_m": TILE_M,
            "tile_n": keys_per_cta(mma, block_size), "threads": 256, "stages": gather_stages(head_dim, 2), "mma": mma}


def kernel_config(dtype: str, head_dim: int, block_size: int, group: int, t: SparseBwdTuning,
                  tau_out: bool = False, deterministic: bool = False) -> dict:
    """sparse_bwd's variant under the choice t; tau_out: it also writes tau for the proxy kernel's "tau" heads;
    deterministic (with tau_out): partial rows stored for sparse_bwd_sums instead of atomics. The warp-specialised
    kernel (a producer warpgroup gathers the tiles) is built for the atomic tau kernels on wgmma at
    PRODUCER_GROUPS."""
    config = {**tile_config(dtype, head_dim, block_size, group, t.mma), "tau_out": int(tau_out),
              "deterministic": int(deterministic)}
    if t.producer and tau_out and not deterministic and t.mma == "wgmma" and group in PRODUCER_GROUPS:
        config["threads"] = PRODUCER_THREADS
    return config


PROXY_TAU_STAGES = 3  # the "tau" proxy kernel gathers its rows two tiles ahead


def proxy_config(dtype: str, head_dim: int, block_size: int, group: int, t: SparseBwdTuning, tau: bool = False,
                 deterministic: bool = False, kl_value: bool = False) -> dict:
    """The proxy backward's variant under the choice t: tau read from the main backward (tau; one variant, built
    at group 1, since it does not depend on G), else recomputed (t.recompute_heads; mma.sync steps through the
    heads); deterministic: its partial-row variant; kl_value (tau): it also forms the entries' KL shares."""
    heads = "tau" if tau else (t.recompute_heads if t.proxy_mma == "wgmma" else "stepped")
    config = tile_config(dtype, head_dim, block_size, 1 if heads == "tau" else group, t.proxy_mma)
    if heads == "tau":
        config["stages"] = PROXY_TAU_STAGES
    return {**config, "heads": heads, "deterministic": int(deterministic), "kl_value": int(kl_value and tau)}


def entry_bytes(block_size: int, group: int, head_dim: int, deterministic: bool = False) -> int:
    """Bytes per plan entry of a tau-path chunk: its tau row (block_size keys, 2 bytes), and when deterministic
    its fp32 partial dq rows (G heads) and dq_p row."""
    return 2 * block_size + ((4 * group * head_dim + 4 * head_dim) if deterministic else 0)


def delta_config(dtype: str, head_dim: int, scale_rows: bool = False) -> dict:
    """bwd_delta's variant; scale_rows: the one that also scales rows by a sink's kept mass (flash_msa_rt.ops.sinks)."""
    return {"dtype": dtype, "head_dim": head_dim, "threads": 256, "scale_rows": int(scale_rows)}


def slot_sum_config(dtype: str, head_dim: int, block_size: int, group: int) -> dict:
    """The deterministic backward's dq (group G) and dq_p (group 1) sums over a query's slots."""
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group, "threads": 256}


def variants(dtype: str, head_dim: int, proxy_head_dim: int, block_size: int, group: int,
             arch: str = "sm90a", deterministic: bool = False) -> list[tuple[str, dict]]:
    """Every (op, config) one backward may launch on arch: with both gradients (tau written and read on the tau
    path), and with one of them missing; deterministic: the deterministic tau path's (deterministic_refusal says
    where there is none)."""
    t = choice(arch, group, head_dim, block_size)
    if deterministic:
        return [("sparse_bwd", kernel_config(dtype, head_dim, block_size, group, t, True, True)),
                ("sparse_bwd_proxy", proxy_config(dtype, proxy_head_dim, block_size, group, t, True, True)),
                ("bwd_delta", delta_config(dtype, head_dim)),
                ("slot_sum", slot_sum_config(dtype, head_dim, block_size, group)),
                ("slot_sum", slot_sum_config(dtype, proxy_head_dim, block_size, 1))] + \
            list_kernel_configs(block_size, arch=arch)
    out = [("sparse_bwd", kernel_config(dtype, head_dim, block_size, group, t)),
           ("sparse_bwd_proxy", proxy_config(dtype, head_dim, block_size, group, t)),
           ("bwd_delta", delta_config(dtype, head_dim))] + list_kernel_configs(block_size, arch=arch)
    if t.tau_path:
        out += [("sparse_bwd", kernel_config(dtype, head_dim, block_size, group, t, tau_out=True)),
                ("sparse_bwd_proxy", proxy_config(dtype, proxy_head_dim, block_size, group, t, tau=True))]
    return out


def tau_path_runs(arch: str, group: int, head_dim: int, block_size: int, both_gradients: bool,
                  deterministic: bool) -> bool:
    """Whether msa_backward_cuda runs the tau path, whose proxy kernel reads tau and the proxy alone: it then takes
    the proxy at its own head dim Dp (the recomputing proxy kernels read the main heads too, so they take the
    proxy zero-padded to D: flash_msa_rt.ops.kernels._proxy_at)."""
    return deterministic or (both_gradients and choice(arch, group, head_dim, block_size).tau_path)


def deterministic_refusal(arch: str) -> str | None:
    """Why arch has no deterministic backward kernels, or None: they are the tau path's (wgmma on both kernels)."""
    t = choice(arch, 1)
    if t.mma == t.proxy_mma == "wgmma":
        return None
    return (f"the deterministic backward kernels are the wgmma tau path (sm90a); {arch} runs sparse_bwd on "
            f"{t.mma!r} and sparse_bwd_proxy on {t.proxy_mma!r}")


def tau_chunk(B: int, S: int, Hp: int, K: int, block_size: int, budget: int, per_entry: int | None = None) -> int:
    """Queries per backward chunk on the tau path: the chunk's rows (B Hp K entries per query, per_entry bytes
    each: entry_bytes, by default a tau row of block_size keys, 2 bytes) fit budget bytes (the choice's) plus
    sparse_fwd.CHUNK_SLACK, in equal whole blocks."""
    per_entry = per_entry or 2 * block_size
    return sparse_fwd.equal_chunk(S, block_size, B * Hp * K * per_entry, budget)


def msa_backward_cuda(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
                      kl_grad, deterministic: bool = False, arch: str | None = None, kl_rows: list | None = None,
                      proxy_scale=None):
    """(dq_proxy, dk_proxy, dq, dk, dv). grad_out (B, S, H, D) or None; kl_grad broadcastable to (B, Hp, S) or
    None (a missing gradient gives zeros). Tensors validated, 16-byte aligned, unit-stride head dim.
    deterministic: bitwise reproducible gradients (the tau path's deterministic variants; the device must have
    them: deterministic_refusal). arch: the device's unless given (the tuning policy's arch). k, v, k_proxy may hold
    Sk >= S keys (query row i at key position Sk - S + i, msa_forward_cuda's alignment): dk, dv, dk_proxy are
    theirs. kl_rows: a list that receives the KL rows (B, Hp, S) where the tau path forms them (the proxy kernel's
    kl_value variant; deferred KL mode), else stays empty. scale: the main scores' (tau); proxy_scale: the proxy
    scores' (pi, and dq_proxy / dk_proxy's factor; None: scale)."""
    B, S, H, D = q.shape
    Hp, Hk = q_proxy.shape[2], k.shape[2]
    G = H // Hp
    dt = sparse_fwd.DTYPES[q.dtype]
    dev = q.device
    f32 = torch.float32
    arch = arch or arch_of(dev)
    t = choice(arch, G, D, block_size, B, S, H)
    mma, mma_p = t.mma, t.proxy_mma
    if deterministic:
        if not mma == mma_p == "wgmma":
            raise NotImplementedError(f"msa_backward deterministic: the kernels are the wgmma tau path (sm90a); this "
                                      f"device runs sparse_bwd on {mma!r}, sparse_bwd_proxy on {mma_p!r}")
        grad_out = grad_out if grad_out is not None else torch.zeros_like(out)
        kl_grad = kl_grad if kl_grad is not None else torch.zeros((B, Hp, S), dtype=f32, device=dev)
        return _backward_with_tau(t, arch, q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size,
                                  scale, grad_out, kl_grad, deterministic=True, kl_rows=kl_rows,
                                  proxy_scale=proxy_scale)
    if grad_out is not None and kl_grad is not None and t.tau_path:
        return _backward_with_tau(t, arch, q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size,
                                  scale, grad_out, kl_grad, kl_rows=kl_rows, proxy_scale=proxy_scale)
    flat, (dq_acc, dk_acc, dv_acc) = accumulators((q, k, v))
    plan = sparse_plan(block_indices, block_size, S, G, TILE_M // G, t.tiles_per_item, key_offset=k.shape[1] - S)
    if grad_out is not None:
        delta = torch.empty((B, H, S), dtype=f32, device=dev)
        get_kernel("bwd_delta", delta_config(dt, D), dev)(dout=grad_out, out=out, delta=delta)
        get_kernel("sparse_bwd", kernel_config(dt, D, block_size, G, t), dev)(
            q=q, k=k, v=v, dout=grad_out, lse=lse.contiguous(), delta=delta, entry_query=plan.entry_query,
            items=plan.items, dq_acc=dq_acc, dk_acc=dk_acc, dv_acc=dv_acc, scale=float(scale), hp=Hp,
            hp_per_hk=Hp // Hk)
    if kl_grad is not None:
        # The main plan's sorted lists, cut into the proxy kernel's tiles (64 distinct queries): no second sort.
        proxy_plan = recut(plan, TILE_M, t.proxy_tiles_per_item)
        dq_proxy, dk_proxy = proxy_backward_cuda(q_proxy, k_proxy, q, k, lse, lse_proxy, block_indices, block_size,
                                                 scale, kl_grad, proxy_plan, arch=arch, proxy_scale=proxy_scale)
    else:
        dq_proxy, dk_proxy = torch.zeros_like(q_proxy), torch.zeros_like(k_proxy)
    return (dq_proxy, dk_proxy, *cast_accumulators(flat, (q, k, v)))


_ALIGN = 128  # elements between accumulators in one buffer: each starts 512-byte aligned, as a fresh allocation


def _slots(like: tuple) -> list[int]:
    return [-(-t.numel() // _ALIGN) * _ALIGN for t in like]


def _views(flat: torch.Tensor, like: tuple) -> list:
    """Contiguous views of flat shaped like `like`, one per slot: one as_strided each (a split, a slice and a view
    would be three torch ops of host time)."""
    views, offset = [], 0
    for t, slot in zip(like, _slots(like)):
        strides, n = [], 1
        for size in reversed(t.shape):
            strides.append(n)
            n *= max(size, 1)
        views.append(flat.as_strided(t.shape, strides[::-1], offset))
        offset += slot
    return views


def accumulators(like: tuple) -> tuple[torch.Tensor, list]:
    """(flat, views): zeroed fp32 accumulators shaped like the tensors of `like`, as views of one buffer: one fill
    launch for all of them instead of one per gradient."""
    flat = torch.zeros(sum(_slots(like)), dtype=torch.float32, device=like[0].device)
    return flat, _views(flat, like)


def cast_accumulators(flat: torch.Tensor, like: tuple) -> list:
    """The accumulators of `accumulators(like)`, each cast to its tensor's dtype into a tensor of its own: a custom
    op's outputs may not share a storage (torch.library checks), so one cast of the flat buffer would not do."""
    return [cast_like(view, t) for view, t in zip(_views(flat, like), like)]


def tau_heads(B: int, S: int, Hp: int, Hk: int, Hpk: int, K: int, block_size: int, budget: int,
              per_entry: int | None = None) -> int:
    """Proxy heads per backward chunk on the tau path: sparse_fwd.heads_per_chunk of the chunk's rows (B S K entries
    per head, per_entry bytes each: entry_bytes, by default a tau row of block_size keys, 2 bytes) in budget bytes
    (tau_budget). Chunks of heads keep every reverse list whole; at (b) 64K chunks of queries measured the same
    within noise for the backward."""
    return sparse_fwd.heads_per_chunk(B * S * K * (per_entry or 2 * block_size), Hp, Hk, Hpk, budget)


def accumulator_heads(B: int, S: int, Hp: int, Hk: int, Hpk: int, G: int, D: int, Dp: int, budget: int) -> int:
    """Proxy heads per backward chunk on the atomic tau path whose fp32 query-gradient accumulators (per head and
    query: dq's G rows of D, dq_proxy's row of Dp) fit budget bytes (accumulator_budget): sparse_fwd.heads_per_chunk.
    The chunk's KV and proxy-key heads' accumulators (dk, dv, dk_proxy) follow from its heads (_ChunkGradients)."""
    return sparse_fwd.heads_per_chunk(4 * B * S * (G * D + Dp), Hp, Hk, Hpk, budget)


chunk_heads = sparse_fwd.chunk_heads


class _ChunkGradients:
    """The tau path's gradients, summed in fp32 accumulators that exist for a run of head chunks only.

    A gradient's accumulator covers the heads that the current chunk adds into (dq: its main heads, dq_proxy: its
    proxy heads, dk and dv: its KV heads, dk_proxy: its proxy-key heads). Consecutive chunks on the same heads
    (proxy heads sharing a KV head) form a run that shares one accumulator; when the run's last chunk is enqueued,
    the accumulator is cast into those heads of the gradient and dropped, so the backward holds one run's fp32, not
    every gradient's (at (b) 1M: 4 GiB instead of 28.5, docs/memory.md). Each fp32 row starts at zero and receives
    the same additions from the same launches, in the same stream order, as a whole-tensor accumulator's row, and
    the cast rounds it alike: the gradients are those of whole accumulators (bitwise where the additions have a
    fixed order: the deterministic kernels).

    Accumulators whose runs start and end at the same chunks share one buffer (one fill launch, as `accumulators`);
    a gradient whose one run covers all its heads (a single chunk: small problems, host-bound) is the cast of its
    accumulator itself, with no copy into a preallocated output.
    """

    def __init__(self, chunks: list, like: dict[str, tuple[torch.Tensor, str]]):
        """chunks: sparse_fwd.head_chunks in launch order; like: gradient name -> (the tensor it is the gradient
        of, its HeadChunk part: "main", "proxy", "kv" or "proxy_key"), heads along dim 2."""
        self.like = like
        self.runs: dict[str, list[list]] = {}  # name -> [first chunk, last chunk, heads] per run
        for name, (_, part) in like.items():
            runs: list[list] = []
            for n, hc in enumerate(chunks):
                heads = getattr(hc, part)
                if runs and runs[-1][2] == heads:
                    runs[-1][1] = n
                else:
                    runs.append([n, n, heads])
            self.runs[name] = runs
        self.acc: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def _run_at(self, name: str, n: int) -> list:
        return next(r for r in self.runs[name] if r[0] <= n <= r[1])

    def begin(self, n: int) -> dict[str, torch.Tensor]:
        """The accumulators chunk n adds into (name -> fp32 (B, S, heads, D)), zeroed where their run starts at n."""
        starting: dict[int, list[str]] = {}  # the run's last chunk -> the gradients whose run starts at n
        for name in self.like:
            first, last, _ = self._run_at(name, n)
            if first == n:
                starting.setdefault(last, []).append(name)
        for names in starting.values():
            parts = tuple(self._heads(name, self._run_at(name, n)[2]) for name in names)
            _, views = accumulators(parts)
            self.acc.update(zip(names, views))
        return dict(self.acc)

    def end(self, n: int) -> None:
        """After chunk n's launches: the accumulators whose run ends at n cast into their gradients and dropped."""
        for name, (t, _) in self.like.items():
            _, last, heads = self._run_at(name, n)
            if last != n:
                continue
            acc = self.acc.pop(name)
            if acc.shape == t.shape:
                self.grads[name] = cast_like(acc, t)
                continue
            if name not in self.grads:
                self.grads[name] = torch.empty_like(t)
            cast_into(acc, self._heads(name, heads, self.grads[name]))

    def _heads(self, name: str, heads: slice, t: torch.Tensor | None = None) -> torch.Tensor:
        t = self.like[name][0] if t is None else t
        return t[:, :, heads]


def _backward_with_tau(t, arch, q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale,
                       grad_out, kl_grad, deterministic: bool = False, kl_rows: list | None = None, proxy_scale=None):
    """(dq_proxy, dk_proxy, dq, dk, dv): both backward kernels per chunk of proxy heads (and of queries, where one
    head's tau rows exceed the budget), tau passed from the main kernel to the proxy kernel. A chunk is the same
    problem on head-sliced views (strided; the kernels take any strides), with its own plan; its fp32 accumulators
    cover its heads only and are cast into the gradients when the chunks that add into them are done
    (_ChunkGradients); chunks on one KV or proxy-key head meet in its accumulator through atomics, as items do.
    Atomic path: the chunks' heads also fit accumulator_budget (accumulator_heads).
    deterministic: the kernels store dq / dq_p partial rows, which each chunk sums in slot order (the slot_sum
    kernel) straight into dq and dq_proxy, and add dk / dv / dk_p in item order (turns); chunks follow each other
    on the stream. kl_rows (a list): the proxy kernel's kl_value variant also adds each entry's KL share (log2
    units) into a zeroed fp32 slot per (b, p, i, slot) of the chunk (its plan's entry_dest, as the deterministic
    partial rows), and each chunk's rows are ln 2 times their slots' sum (KL = ln 2 sum A + lse_p sum T, as the
    KL pass's merge); the (B, Hp, S) rows are appended to the list. proxy_scale: the proxy kernel's one scale (None:
    scale; the main kernel's tau rows are at scale)."""
    B, S, H, D = q.shape
    Hp, Hk, Hpk, K = q_proxy.shape[2], k.shape[2], k_proxy.shape[2], block_indices.shape[3]
    G = H // Hp
    dt = sparse_fwd.DTYPES[q.dtype]
    dev = q.device
    f32 = torch.float32
    det = deterministic
    main = get_kernel("sparse_bwd", kernel_config(dt, D, block_size, G, t, True, det), dev)
    with_kl = kl_rows is not None
    # the tau kernel reads the proxy and tau only: it runs at the proxy's own head dim (tau_path_runs)
    proxy = get_kernel("sparse_bwd_proxy", proxy_config(dt, q_proxy.shape[3], block_size, G, t, True, det, with_kl),
                       dev)
    delta = torch.empty((B, H, S), dtype=f32, device=dev)
    get_kernel("bwd_delta", delta_config(dt, D), dev)(dout=grad_out, out=out, delta=delta)
    if kl_grad.dtype != f32 or kl_grad.device != dev:  # a no-op .to still costs a torch op
        kl_grad = kl_grad.to(device=dev, dtype=f32)
    grad = torch.broadcast_to(kl_grad, (B, Hp, S)).contiguous()
    lse, lse_proxy = lse.contiguous(), lse_proxy.contiguous()
    budget = t.deterministic_budget if det else t.tau_budget
    per_entry = entry_bytes(block_size, G, D, det)
    c = tau_heads(B, S, Hp, Hk, Hpk, K, block_size, budget, per_entry)
    if not det:  # the deterministic path sums dq in the output itself: no query-gradient accumulators
        c = min(c, accumulator_heads(B, S, Hp, Hk, Hpk, G, D, q_proxy.shape[3], t.accumulator_budget))
    chunk = tau_chunk(B, S, c, K, block_size, budget, per_entry)
    rows = B * c * min(chunk, S) * K
    proxy_tiles = per_group_tiles(128, 1)  # the "tau" kernel's tiles hold 64 queries of one head
    # Every chunk's main plan and its recut into the proxy kernel's tiles from one sort (sparse_plan.chunk_plans;
    # before the tau rows and the accumulators exist, so the sort's temporaries do not add to the peak). The main
    # plan's sorted lists are the proxy plan's: entry e's tau row is row e for both.
    cuts = ((TILE_M // G, t.tiles_per_item), (TILE_M, proxy_tiles))
    # the deterministic kernels' turns need list order; the sorted lists are the MSA forward's where it kept them
    plans = chunk_plans(block_indices, block_size, G, c, chunk, cuts, "list" if det else t.item_order, arch=arch,
                        key_offset=k.shape[1] - S, take_lists=True, bin_queries=t.bin_queries)
    tau = torch.empty((rows, block_size), dtype=q.dtype, device=dev)
    if with_kl:
        kl_slots = torch.empty(rows, dtype=f32, device=dev)
        kl_out = torch.empty((B, Hp, S), dtype=f32, device=dev)
    chunks = sparse_fwd.head_chunks(Hp, Hk, Hpk, G, c)
    like = {"dk_proxy": (k_proxy, "proxy_key"), "dk": (k, "kv"), "dv": (v, "kv")}
    if det:
        sums = _DeterministicSums(q_proxy, q, rows, block_size)
    else:
        like = {"dq_proxy": (q_proxy, "proxy"), **like, "dq": (q, "main")}
    grads = _ChunkGradients(chunks, like)
    for n, hc in enumerate(chunks):
        acc = grads.begin(n)
        main_args = dict(q=hc.view(q, 2, "main"), k=hc.view(k, 2, "kv"), v=hc.view(v, 2, "kv"),
                         dout=hc.view(grad_out, 2, "main"), lse=hc.view(lse, 1, "main"),
                         delta=hc.view(delta, 1, "main"), dk_acc=acc["dk"], dv_acc=acc["dv"], scale=float(scale),
                         hp=c, hp_per_hk=hc.per_kv)
        proxy_args = dict(q_proxy=hc.view(q_proxy, 2, "proxy"), k_proxy=hc.view(k_proxy, 2, "proxy_key"),
                          lse_proxy=hc.view(lse_proxy, 1, "proxy"), kl_grad=hc.view(grad, 1, "proxy"),
                          dkp_acc=acc["dk_proxy"], proxy_scale=_proxy_scale(scale, proxy_scale),
                          hp_per_hpk=hc.per_pk)
        if not det:
            main_args.update(dq_acc=acc["dq"])
            proxy_args.update(dqp_acc=acc["dq_proxy"])
        for s0 in range(0, S, chunk):
            s1 = min(S, s0 + chunk)
            plan, proxy_plan = plans[(hc.p0, s0)]
            tau_rows = sparse_fwd.rows(tau, 0, 0, plan.E)
            if det:
                sel = block_indices if hc.every and s1 - s0 == S else block_indices[:, hc.proxy, s0:s1].contiguous()
                main_args.update(sums.main_args(plan, c, hc.per_kv))
                proxy_args.update(sums.proxy_args(proxy_plan, c, hc.per_pk))
            main(entry_query=plan.entry_query, items=plan.items, tau=tau_rows, **main_args)
            if with_kl:
                n_p = hc.proxy.stop - hc.proxy.start
                slots = kl_slots[:B * n_p * (s1 - s0) * K]
                slots.zero_()
                proxy_args.update(kl_dest=proxy_plan.entry_dest, kl_slots=slots)
            proxy(tau=tau_rows, entry_query=proxy_plan.entry_query, items=proxy_plan.items, **proxy_args)
            if with_kl:
                torch.sum(slots.view(B, n_p, s1 - s0, K), -1, out=kl_out[:, hc.proxy, s0:s1])
            if det:
                sums.sum_chunk(plan, sel, s0, s1, hc.main, hc.proxy)
        del acc, main_args, proxy_args  # the run accumulators that end here are grads' only references
        grads.end(n)
    g = grads.grads
    if with_kl:
        kl_rows.append(kl_out.mul_(math.log(2.0)))
    if det:
        return sums.dqp, g["dk_proxy"], sums.dq, g["dk"], g["dv"]
    return g["dq_proxy"], g["dk_proxy"], g["dq"], g["dk"], g["dv"]


class _DeterministicSums:
    """The deterministic tau path's query gradients and turns: per chunk, fp32 partial dq / dq_p rows at the chunk's
    slot rows, which the slot_sum kernel adds in slot order into dq and dq_proxy (a query's slots all live in its
    chunk); per launch, the items' turns for their key-block atomics (sparse_bwd_sums.item_turns)."""

    def __init__(self, q_proxy, q, rows: int, block_size: int):
        B, S, H, D = q.shape
        Hp, dev, f32 = q_proxy.shape[2], q.device, torch.float32
        G, dt = H // Hp, sparse_fwd.DTYPES[q.dtype]
        self.dq_part = torch.empty((rows, G, D), dtype=f32, device=dev)
        self.dqp_part = torch.empty((rows, 1, q_proxy.shape[3]), dtype=f32, device=dev)
        self.dq = torch.empty_like(q)  # the inputs' layouts: cast_like
        self.dqp = torch.empty_like(q_proxy)
        self.sum_dq = get_kernel("slot_sum", slot_sum_config(dt, D, block_size, G), dev)
        self.sum_dqp = get_kernel("slot_sum", slot_sum_config(dt, q_proxy.shape[3], block_size, 1), dev)

    def main_args(self, plan, c: int, per_kv: int) -> dict:
        prev, done = sparse_bwd_sums.item_turns(plan.items, c, per_kv)
        return dict(dq_part=self.dq_part[:plan.E].view(plan.E, -1), entry_dest=plan.entry_dest, item_prev=prev,
                    item_done=done)

    def proxy_args(self, proxy_plan, c: int, per_pk: int) -> dict:
        prev, done = sparse_bwd_sums.item_turns(proxy_plan.items, c, per_pk)
        return dict(dqp_part=self.dqp_part[:proxy_plan.E, 0], entry_dest=proxy_plan.entry_dest, item_prev=prev,
                    item_done=done)

    def sum_chunk(self, plan, sel, s0: int, s1: int, hs: slice, ps: slice) -> None:
        """dq and dq_proxy of the chunk's queries [s0, s1) and heads hs / proxy heads ps, from the partial rows
        that the chunk's plan (over selection rows sel) stored."""
        at = plan.key_offset + s0  # the live rule's key position of row s0
        self.sum_dq(block_indices=sel, part=self.dq_part[:plan.E], out=self.dq[:, s0:s1, hs], query_offset=at)
        self.sum_dqp(block_indices=sel, part=self.dqp_part[:plan.E], out=self.dqp[:, s0:s1, ps], query_offset=at)


def proxy_backward_cuda(q_proxy, k_proxy, q, k, lse, lse_proxy, block_indices, block_size, scale, kl_grad, plan=None,
                        arch: str | None = None, proxy_scale=None):
    """(dq_proxy, dk_proxy) from (pi - tau) * kl_grad over a selection: the sparse_bwd_proxy kernel alone (warmup
    mode runs it with every causal block selected, beside cuDNN's dense backward). plan: the whole selection's plan
    in the proxy kernel's tiles (64 distinct queries; msa_backward_cuda recuts its main plan), or None to plan here
    in query chunks. scale: the main scores' (the recomputed tau); proxy_scale: the proxy scores' (pi, and dq_proxy /
    dk_proxy's factor; None: scale)."""
    B, S, H, D = q.shape
    Hp, Hk, Hpk = q_proxy.shape[2], k.shape[2], k_proxy.shape[2]
    G = H // Hp
    dev = q.device
    f32 = torch.float32
    dqp_acc = torch.zeros(q_proxy.shape, dtype=f32, device=dev)
    dkp_acc = torch.zeros(k_proxy.shape, dtype=f32, device=dev)
    grad = torch.broadcast_to(kl_grad.to(device=dev, dtype=f32), (B, Hp, S)).contiguous()
    t = choice(arch or arch_of(dev), G, D, block_size, B, S, H)
    kernel = get_kernel("sparse_bwd_proxy", proxy_config(sparse_fwd.DTYPES[q.dtype], D, block_size, G, t), dev)
    lse, lse_proxy = lse.contiguous(), lse_proxy.contiguous()
    K = block_indices.shape[3]
    # Queries in chunks of at most t.plan_entries (b, p, i, slot) entries: warmup's all-causal selection has
    # O(B * Hp * S^2 / Bs) of them (the accumulators sum the chunks' contributions like the items').
    given = plan
    chunk = S if given is not None else max(block_size,
                                            t.plan_entries // max(1, B * Hp * K) // block_size * block_size)
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        if given is None:  # the proxy kernel's tiles are 64 distinct queries, whatever G
            sel = block_indices[:, :, s0:s1].contiguous()
            plan = sparse_plan(sel, block_size, s1 - s0, G, TILE_M, t.proxy_tiles_per_item, query_offset=s0,
                               key_offset=k_proxy.shape[1] - S)
        kernel(q=q, k=k, q_proxy=q_proxy, k_proxy=k_proxy, entry_query=plan.entry_query, items=plan.items, lse=lse,
               lse_proxy=lse_proxy, kl_grad=grad, dqp_acc=dqp_acc, dkp_acc=dkp_acc, scale=float(scale),
               proxy_scale=_proxy_scale(scale, proxy_scale), hp_per_hk=Hp // Hk, hp_per_hpk=Hp // Hpk)
    return cast_like(dqp_acc, q_proxy), cast_like(dkp_acc, k_proxy)


def _proxy_scale(scale, proxy_scale) -> float:
    """The proxy scores' scale as the kernels take it (None: the main scale)."""
    return float(scale if proxy_scale is None else proxy_scale)
