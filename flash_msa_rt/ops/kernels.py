"""The CUDA kernel backend: the ops whose AOT kernels are built for the device, registered with dispatch.

Today: selection (flash_msa_rt.ops.select), the MSA sparse forward (flash_msa_rt.ops.sparse_fwd) and backward
(flash_msa_rt.ops.sparse_bwd), block-sparse attention over given indices on the same kernels
(flash_msa_rt.ops.block_sparse), and warmup mode: its dense main attention on cuDNN (flash_msa_rt.ops.dense_main,
torch's own operators) and its proxy KL pass and proxy backward on the dense warmup kernels
(flash_msa_rt.ops.warmup_kl) where they are built, else on the sparse kernels with every causal block selected
(and everything on the sparse kernels where this torch lacks the cuDNN operators). Packed sequences (cu_seqlens)
run on the same kernels one sequence at a time (flash_msa_rt.ops.packed); separate key offsets (cu_seqlens_k,
seqused_k) run on the reference, and dispatch says so once (flash_msa_rt.ops.dispatch registers this backend;
this module does not import dispatch). A proxy head dim Dp below D (PADDED_PROXY_HEAD_DIMS) selects on the
selection kernel's own Dp variants and runs the KL pass and proxy backward on the D kernels over the proxy
zero-padded to D (_proxy_at). What is built is read from the manifest. A problem a kernel cannot run
(dtype, head dim, block size, K, G, separate key offsets, deterministic mode where no deterministic kernels exist
(sm100a, warmup's and block-sparse attention's backward), or a variant not built for this GPU) is declined with
the reason, which dispatch shows with the build command; a declined call is never an error.
"""

from __future__ import annotations

import warnings

import torch

from flash_msa_rt import artifacts, loader
from flash_msa_rt.errors import FlashMsaError
from flash_msa_rt.ops import block_sparse, block_split, dense_main, packed, select, sparse_bwd, sparse_fwd, warmup_kl
from flash_msa_rt.ops.backends import Backend, Problem, reference_impl
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.ops.grad_cast import cast_like
from flash_msa_rt.tuning import packed as tuning_packed
from flash_msa_rt.tuning import warmup as tuning_warmup
from flash_msa_rt.tuning.head_dim import kernel_block_size

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}
_SEPARATE_KEYS = ("separate key offsets (cu_seqlens_k, seqused_k): tuning.packed's separate_keys is "
                  "'reference' (an override), so they run on the pure-PyTorch reference; the default 'kernels' "
                  "runs them on the fixed-length kernels (flash_msa_rt.ops.packed)")


def _separate_keys_declined(problem: Problem) -> bool:
    return bool(problem.config.get("separate_keys")) and \
        tuning_packed.choose(_arch(problem)).separate_keys != "kernels"


def _built(problem: Problem, variants: list[tuple[str, dict]]) -> str | None:
    """None when every (op, config) variant is in the device's artifacts, else the loader's reason (which names
    the build command)."""
    try:
        for op, config in variants:
            loader.find_variant(op, config, _arch(problem))
    except FlashMsaError as e:
        return str(e)
    return None


# Options of issue 58: the sinks never reach a backend (flash_msa_rt.ops.library applies them around the sink-free
# kernels); proxy_scale reaches every proxy kernel (the KL passes and proxy backwards take it beside the main
# scale); local_blocks reaches the selection kernel as its runtime scalar (every L on the same variants).


def _select_supports(problem: Problem) -> str | None:
    c = problem.config
    if _separate_keys_declined(problem):
        return _SEPARATE_KEYS
    if problem.dtype not in _DTYPE_NAMES:
        return f"dtype {problem.dtype} (selection kernel: bfloat16, float16)"
    dp, bs, k = c.get("proxy_head_dim"), c.get("block_size"), c.get("top_k_blocks")
    arch, dt = _arch(problem), select.variant_dtype(_DTYPE_NAMES[problem.dtype], c.get("select_precision", "bf16"))
    dims = loader.built_values("select", "head_dim", arch, dtype=dt)
    sizes = loader.built_values("select", "block_size", arch, dtype=dt)
    max_k = select.max_k_for(k, arch)
    if dp not in dims or bs not in sizes or max_k is None:
        return (f"proxy head dim {dp}, block_size {bs}, K {k} (selection kernel built for {arch}, {dt}: head dim "
                f"in {dims}, block_size {sizes}, K <= {max(loader.built_values('select', 'max_k', arch), default=0)})")
    precision = c.get("select_precision", "bf16")
    config = select.kernel_config(dt, dp, bs, max_k, select.mma_for(arch, precision),
                                  select.schedule_for(arch, precision, bs))
    quantize = select.quantize_variants(_DTYPE_NAMES[problem.dtype], dp, bs, arch, precision)
    return _built(problem, [("select", config), *quantize])


_DETERMINISTIC_REASON = (
    "torch.use_deterministic_algorithms(True) is on and {why}; the backward runs on the pure-PyTorch reference "
    "instead (bitwise reproducible, much slower)")
_warned_deterministic = False


def _msa_supports(problem: Problem) -> str | None:
    """msa_forward and msa_backward: the same problem limits, each op's own variants (under deterministic
    algorithms, the backward's deterministic ones where the arch has them)."""
    c = problem.config
    deterministic = bool(c.get("deterministic")) and problem.op == "msa_backward"
    why = sparse_bwd.deterministic_refusal(_arch(problem)) if deterministic else None
    if why:
        return _decline_deterministic(why)
    if _separate_keys_declined(problem):
        return _SEPARATE_KEYS
    if problem.dtype not in _DTYPE_NAMES:
        return f"dtype {problem.dtype} (sparse forward kernel: bfloat16, float16)"
    d, dp, bs, g, kv_group = (c.get(n) for n in ("head_dim", "proxy_head_dim", "block_size", "group", "kv_group"))
    limits = _sparse_limits(problem, d, bs, g, dp)
    if limits:
        return limits
    if kv_group % g:
        return (f"H / Hk = {kv_group} is not a multiple of G = H / Hp = {g}: the sparse forward kernel needs "
                f"Hp >= Hk with Hp a multiple of Hk")
    # The proxy reaches the forward's KL pass and the recomputing proxy backward at D (_proxy_at), the tau path's
    # proxy kernel at its own Dp (sparse_bwd.tau_path_runs).
    kbs = kernel_block_size(d, bs)  # a selection's blocks as the main kernels take them (block_split)
    if problem.op == "msa_forward":
        return _built(problem, sparse_fwd.variants(_DTYPE_NAMES[problem.dtype], d, d, kbs, g, _arch(problem),
                                                   bool(c.get("sinks"))))
    return _built(problem, sparse_bwd.variants(_DTYPE_NAMES[problem.dtype], d, dp or d, kbs, g, _arch(problem),
                                               deterministic))


def _sparse_limits(problem: Problem, d: int, bs: int, g: int, dp: int | None = None) -> str | None:
    """None when the sparse forward is built for (dtype, D, block size, G) on the device's arch and Dp is D or one
    of PADDED_PROXY_HEAD_DIMS below it, else what is built there (the manifest's variants: what the build made)."""
    arch, dt = _arch(problem), _DTYPE_NAMES[problem.dtype]
    dims = loader.built_values("sparse_fwd", "head_dim", arch, dtype=dt)
    sizes = loader.built_values("sparse_fwd", "block_size", arch, dtype=dt)
    groups = loader.built_values("sparse_fwd", "group", arch, dtype=dt)
    if d not in dims or not _proxy_dim_ok(d, dp) or kernel_block_size(d, bs) not in sizes or g not in groups:
        have = (f"D in {dims} with Dp = D or Dp in {PADDED_PROXY_HEAD_DIMS} below D" if dp is not None
                else f"D in {dims}")
        return (f"D {d}, {'' if dp is None else f'Dp {dp}, '}block_size {bs}, G {g} (sparse kernels built for {arch}, "
                f"{dt}: {have}, block_size {sizes}, G in {groups}); {_how_to_get(arch, dt, d, bs, dp)}")
    return None


# Points of the contract's matrix no kernel build reaches, with the measurement (kernels_src's can_implement
# refuses them; tests/test_matrix_cpu.py checks that this table and the catalogue agree). The runtime never imports
# the catalogue, so it keeps the facts here.
UNREACHABLE_HEAD_DIMS: dict[int, str] = {}  # none today: D 256 runs on 64-key blocks (tuning.head_dim)


def _how_to_get(arch: str, dt: str, d: int, bs: int, dp: int | None) -> str:
    """The command that builds a configuration's kernels, or why none can."""
    if d in UNREACHABLE_HEAD_DIMS:
        return UNREACHABLE_HEAD_DIMS[d]
    if dp is not None and dp > d:
        return (f"a proxy wider than the heads (Dp {dp} > D {d}) is not built: the KL pass takes the proxy at D; "
                f"use Dp <= D")
    if dp is not None and not _proxy_dim_ok(d, dp):
        return f"proxy head dim {dp} is not one the kernels are written for (Dp in {PADDED_PROXY_HEAD_DIMS})"
    return "build them: " + artifacts.build_command(arch, {"dtype": dt, "head_dim": d, "block_size": bs})


# Proxy head dims below D that the KL pass and the proxy backward (sparse and warmup kernels, built for Dp = D)
# take by zero-padding the proxy to D (_proxy_at): those the selection kernel has native variants of
# (kernels_src/select), so a model with a smaller proxy runs every op on kernels. The padding costs one copy of
# q_proxy and k_proxy at D per call of the forward's KL pass, the deferred KL pass and the backward (B = 2,
# S = 64K, Hp = 8, Hpk = 1 in bf16: 302 MB written, 151 MB read, ~0.1 ms at 4 TB/s), proxy gradients made D wide
# before the cut, and D / Dp times the proxy MMA work a native Dp kernel would do in those kernels; the selection,
# the only quadratic proxy work outside warmup, runs at Dp (docs/kernel-notes.md, "A proxy head dim below D").
PADDED_PROXY_HEAD_DIMS = (64, 128)


def _proxy_dim_ok(d: int, dp: int | None) -> bool:
    return dp is None or dp == d or (dp < d and dp in PADDED_PROXY_HEAD_DIMS)


def _proxy_at(q_proxy: torch.Tensor, k_proxy: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proxy and k_proxy as the D kernels take them: themselves when Dp = D, else zero-padded along the head dim
    to D (fresh contiguous tensors; no host synchronisation, so CUDA graph capture is unaffected).

    Exact: the padded columns meet only each other, so each proxy score gains products 0 x 0 = 0, and adding an
    exact zero leaves a float32 accumulator unchanged. The proxy scores, hence lse_proxy, the KL and
    dS_p = (pi - tau) kl_grad, are those of the unpadded pair. Column c of dq_proxy = scale dS_p K_p and of
    dk_proxy = scale dS_p^T Q_p reads column c of K_p or Q_p only, so the first Dp columns are the unpadded
    gradients and the rest (zeros) are cut off (_proxy_grads)."""
    dp = q_proxy.shape[-1]
    if dp == d:
        return q_proxy, k_proxy
    return tuple(torch.nn.functional.pad(t, (0, d - dp)) for t in (q_proxy, k_proxy))


def _proxy_grads(grads: tuple, q_proxy: torch.Tensor, k_proxy: torch.Tensor, d: int) -> tuple:
    """A backward's (dq_proxy, dk_proxy, dq, dk, dv) computed with the proxy at D (_proxy_at): as they are when
    Dp = D, else with the proxy gradients cut to their first Dp columns, written in the unpadded q_proxy's and
    k_proxy's layouts (cast_like: what the kernels give every other gradient, so autograd copies none)."""
    if q_proxy.shape[-1] == d:
        return grads
    dq_proxy, dk_proxy, *rest = grads
    dp = q_proxy.shape[-1]
    return (cast_like(dq_proxy[..., :dp], q_proxy), cast_like(dk_proxy[..., :dp], k_proxy), *rest)


def _decline_deterministic(why: str) -> str:
    global _warned_deterministic
    reason = _DETERMINISTIC_REASON.format(why=why)
    if not _warned_deterministic:  # dispatch's own fallback warning is shown once for all reasons
        _warned_deterministic = True
        warnings.warn(f"flash_msa: {reason}", RuntimeWarning, stacklevel=5)
    return reason


def _arch(problem: Problem) -> str:
    """The arch of the problem's device (asked each time dispatch resolves a problem: tests fake devices)."""
    return loader.device_arch(problem.device.index if problem.device.index is not None
                              else torch.cuda.current_device())


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA wants a unit-stride head dim and 16-byte multiples elsewhere; other views are copied once."""
    ok = t.stride(-1) == 1 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]) \
        and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()


def _select_blocks(q_proxy, k_proxy, top_k_blocks, block_size, scale, cu_seqlens=None, *, precision="bf16",
                   local_blocks=1):
    if -(-k_proxy.shape[1] // block_size) >= select.MAX_BLOCKS:  # int16 block slots: beyond 4M tokens
        return reference_impl("select_blocks")(q_proxy, k_proxy, top_k_blocks, block_size, scale, cu_seqlens,
                                               precision=precision, local_blocks=local_blocks)
    return select.select_blocks_cuda(_tma_ready(q_proxy), _tma_ready(k_proxy), top_k_blocks, block_size, scale,
                                     precision, local_blocks)


def _msa_forward(q_proxy, k_proxy, q, k, v, block_indices, block_size, scale, cu_seqlens=None, *, kl=True,
                 proxy_scale=None, sinks=None):
    """proxy_scale (here and in every op below): the proxy scores' scale (None: scale). sinks: out scaled by each
    row's kept mass in the combine, lse sink-free (flash_msa_rt.ops.library's msa_forward contract)."""
    assert cu_seqlens is None, "packed.per_sequence passes one sequence at a time"
    block_indices, block_size = block_split.kernel_selection(block_indices, block_size, q.shape[3], k.shape[1])
    if kl:
        q_proxy, k_proxy = _proxy_at(q_proxy, k_proxy, q.shape[3])
        return sparse_fwd.msa_forward_cuda(*(_tma_ready(t) for t in (q_proxy, k_proxy, q, k, v)),
                                           block_indices.contiguous(), block_size, scale, keep_lists=True,
                                           proxy_scale=proxy_scale, sinks=sinks)
    # The main attention alone (the same sparse_fwd and combine launches): lse_proxy and kl_rows come from msa_kl
    # in the backward, whose plans take the sorted lists this forward keeps (sparse_plan.chunk_plans).
    out, lse, _, _ = sparse_fwd.msa_forward_cuda(None, None, *(_tma_ready(t) for t in (q, k, v)),
                                                 block_indices.contiguous(), block_size, scale, keep_lists=True,
                                                 sinks=sinks)
    return out, lse, *_no_kl(q_proxy)


def _no_kl(q_proxy) -> tuple[torch.Tensor, torch.Tensor]:
    """lse_proxy and kl_rows of a forward without the KL pass: zeros (kl_loss's forward value is then 0)."""
    B, S, Hp, _ = q_proxy.shape
    return tuple(torch.zeros((B, Hp, S), dtype=torch.float32, device=q_proxy.device) for _ in range(2))


def _msa_kl(q_proxy, k_proxy, q, k, v, lse, block_indices, block_size, scale, cu_seqlens=None, *, with_kl=True,
            proxy_scale=None):
    """with_kl False: lse_proxy is what is asked for: the proxy lse kernel where built (msa_kl_cuda)."""
    assert cu_seqlens is None, "packed.per_sequence passes one sequence at a time"
    D, G = q.shape[3], q.shape[2] // q_proxy.shape[2]
    block_indices, block_size = block_split.kernel_selection(block_indices, block_size, D, k.shape[1])
    # The proxy lse alone reads the proxy only: at its own Dp, no padded copy (deferred KL's forward).
    dt = _DTYPE_NAMES.get(q.dtype)
    if with_kl or dt is None or not sparse_fwd.lse_only_runs(dt, D, q_proxy.shape[3], block_size, G,
                                                             arch_of(q.device)):
        q_proxy, k_proxy = _proxy_at(q_proxy, k_proxy, D)
    return sparse_fwd.msa_kl_cuda(*(_tma_ready(t) for t in (q_proxy, k_proxy, q, k)), lse, block_indices.contiguous(),
                                  block_size, scale, with_kl=with_kl, proxy_scale=proxy_scale)


def _kl_value_out(rows: torch.Tensor, kl_metric, kl_rows_out) -> None:
    """A backward's KL rows to whoever asked: the mean into kl_metric (flash_msa_rt.api's kl_loss), or the rows
    themselves into kl_rows_out (a pack's call: packed.per_sequence averages over the pack's real rows)."""
    if kl_rows_out is not None:
        kl_rows_out.append(rows)
    if kl_metric is not None:
        kl_metric.copy_(rows.sum() / max(rows.numel(), 1))


def _msa_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, block_indices, block_size, scale, grad_out,
                  kl_grad, cu_seqlens=None, kl_metric=None, proxy_scale=None, kl_rows_out=None):
    """kl_metric: also the mean KL value into it (deferred mode): from the proxy backward where its kl_value
    variant runs (the tau path), else from the KL pass. kl_rows_out (a list; packed.per_sequence's): receives the
    KL rows (B, Hp, S) instead, for a mean over a pack's real rows."""
    assert cu_seqlens is None, "packed.per_sequence passes one sequence at a time"
    deterministic = torch.are_deterministic_algorithms_enabled()
    D, G = q.shape[3], q.shape[2] // q_proxy.shape[2]
    block_indices, block_size = block_split.kernel_selection(block_indices, block_size, D, k.shape[1])
    # The tau path's proxy kernel reads the proxy alone, at its own head dim; the others take it at D.
    native = sparse_bwd.tau_path_runs(arch_of(q.device), G, D, block_size,
                                      grad_out is not None and kl_grad is not None, deterministic)
    qp, kp = (q_proxy, k_proxy) if native else _proxy_at(q_proxy, k_proxy, D)
    qp, kp, q_, k_, v_, out = (_tma_ready(t) for t in (qp, kp, q, k, v, out))
    grad_out = _tma_ready(grad_out) if grad_out is not None else None
    wanted = kl_metric is not None or kl_rows_out is not None
    kl_rows = [] if wanted else None  # the backward appends the rows when it forms them
    grads = sparse_bwd.msa_backward_cuda(qp, kp, q_, k_, v_, out, lse, lse_proxy, block_indices.contiguous(),
                                         block_size, scale, grad_out, kl_grad, deterministic=deterministic,
                                         kl_rows=kl_rows, proxy_scale=proxy_scale)
    if wanted:
        rows = kl_rows[0] if kl_rows else _msa_kl(q_proxy, k_proxy, q, k, v, lse, block_indices, block_size,
                                                  scale, proxy_scale=proxy_scale)[1]
        _kl_value_out(rows, kl_metric, kl_rows_out)
    return grads if native else _proxy_grads(grads, q_proxy, k_proxy, D)


# Warmup's KL pass and proxy backward run on the dense kernels where they are built (flash_msa_rt.ops.warmup_kl:
# sm90a; the KL pass at G <= 4, the proxy backward at every G) and on the sparse kernels over the all-causal
# selection elsewhere, or where tuning.warmup says so (dense_proxy).
WARMUP_BLOCK = 128  # warmup selects every causal block; any block size gives the same dense causal result
_INT32_LIMIT = 1 << 31


def _warmup_block(q) -> int:
    """Warmup's all-causal blocks: WARMUP_BLOCK, or the main kernels' own block where smaller (D 256: 64)."""
    return kernel_block_size(q.shape[3], WARMUP_BLOCK)


def _warmup_selection(q_proxy, q) -> tuple[torch.Tensor, int]:
    """Warmup's all-causal selection, whole, and its block size: what the sparse main path takes."""
    block_size = _warmup_block(q)
    return _all_causal_blocks(q_proxy, block_size), block_size


class AllCausalBlocks:
    """Warmup's selection, (B, Hp, S, NB) int32: every block j <= blk(i), -1 after it. Warmup mode is MSA with this
    selection (msa-semantics.md: A_h(i) = T = {t <= i}), which is how the proxy's KL pass and backward kernels run
    it. Rows are made when sliced ([:, :, s0:s1], what the query-chunked launchers take), so the whole
    O(B * Hp * S^2 / Bs) tensor never exists (2.1 GB at B = 2, Hp = 8, S = 64K)."""

    def __init__(self, q_proxy: torch.Tensor, block_size: int):
        B, S, Hp, _ = q_proxy.shape
        self.shape = (B, Hp, S, -(-S // block_size))
        self.block_size = block_size
        self.device = q_proxy.device

    def __getitem__(self, index) -> torch.Tensor:
        if not (isinstance(index, tuple) and len(index) == 3 and index[0] == slice(None) and index[1] == slice(None)
                and isinstance(index[2], slice) and index[2].step in (None, 1)):
            raise TypeError(f"AllCausalBlocks supports [:, :, s0:s1] only, got {index!r}")
        B, Hp, S, NB = self.shape
        s0, s1, _ = index[2].indices(S)
        j = torch.arange(NB, device=self.device, dtype=torch.int32)
        local = torch.arange(s0, max(s0, s1), device=self.device, dtype=torch.int32) // self.block_size
        sel = torch.where(j.view(1, NB) <= local.view(-1, 1), j.view(1, NB),
                          torch.full((), -1, dtype=torch.int32, device=self.device))
        return sel.view(1, 1, -1, NB).expand(B, Hp, -1, NB)


def _all_causal_blocks(q_proxy: torch.Tensor, block_size: int) -> torch.Tensor:
    """AllCausalBlocks, whole (the sparse main path plans every row at once)."""
    sel = AllCausalBlocks(q_proxy, block_size)
    return sel[:, :, 0:sel.shape[2]].contiguous()


def _warmup_entries(q_proxy, block_size: int) -> int:
    """(b, p, i, block) entries of the all-causal selection."""
    B, S, Hp, _ = q_proxy.shape
    nb = -(-S // block_size)
    return B * Hp * (S * nb - block_size * nb * (nb - 1) // 2)


_cudnn_failed: dict = {}  # device index -> the error cuDNN's attention raised there (then: the sparse main path)


def _dense_main(q) -> bool:
    """cuDNN runs warmup's main attention when this torch has the operators (dense_main.available), cuDNN is
    usable and has not refused this device; otherwise the sparse kernels run it with every causal block
    selected. A one-token sequence (a packed document of length 1) goes to the sparse kernels too: cuDNN refuses
    s_q = s_kv = 1 (H200, cuDNN frontend), which must not mark the device as refusing."""
    index = q.device.index if q.device.type == "cuda" and q.device.index is not None else 0
    return (_warmup_tuning(q).dense_main and dense_main.available() is None and torch.backends.cudnn.is_available()
            and index not in _cudnn_failed and q.shape[1] > 1)


def _warmup_tuning(q) -> tuning_warmup.WarmupTuning:
    return tuning_warmup.choose(arch_of(q.device))


def _cudnn_refused(q, error: RuntimeError) -> None:
    """Remember that cuDNN's attention refused this device (e.g. a cuDNN without SDPA support) and say so once;
    warmup then runs its main attention on the sparse kernels there (the same results, about 2x slower)."""
    index = q.device.index if q.device.index is not None else 0
    _cudnn_failed[index] = error
    warnings.warn(f"flash_msa: cuDNN attention failed on cuda:{index} ({str(error).splitlines()[0][:200]}); warmup "
                  f"mode runs its main attention on the sparse kernels there instead", RuntimeWarning, stacklevel=4)


def _warmup_fits(q_proxy, q) -> bool:
    """The sparse main path plans every (entry, head) row at once, in int32; the cuDNN path plans the proxy's
    work in chunks of queries (sparse_fwd.msa_kl_cuda, sparse_bwd.proxy_backward_cuda) and always fits."""
    return _dense_main(q) or _warmup_entries(q_proxy, _warmup_block(q)) * (q.shape[2] // q_proxy.shape[2]) < \
        _INT32_LIMIT


def _warmup_forward(q_proxy, k_proxy, q, k, v, scale, cu_seqlens=None, *, kl=True, proxy_scale=None):
    assert cu_seqlens is None, "packed.per_sequence passes one sequence at a time"
    if not _warmup_fits(q_proxy, q):
        return reference_impl("warmup_forward")(q_proxy, k_proxy, q, k, v, scale, cu_seqlens, kl=kl,
                                                proxy_scale=proxy_scale)
    if kl:
        q_proxy, k_proxy = _proxy_at(q_proxy, k_proxy, q.shape[3])
    if not _dense_main(q):
        return _msa_forward(q_proxy, k_proxy, q, k, v, *_warmup_selection(q_proxy, q), scale, kl=kl,
                            proxy_scale=proxy_scale)
    q_proxy, k_proxy, q, k, v = (_tma_ready(t) for t in (q_proxy, k_proxy, q, k, v))
    try:
        out, lse = dense_main.dense_forward(q, k, v, scale)
    except RuntimeError as e:
        _cudnn_refused(q, e)
        return _msa_forward(q_proxy, k_proxy, q, k, v, *_warmup_selection(q_proxy, q), scale, kl=kl,
                            proxy_scale=proxy_scale)
    return (out, lse, *(_dense_warmup_kl(q_proxy, k_proxy, q, k, lse, scale, proxy_scale) if kl
                        else _no_kl(q_proxy)))


def _dense_warmup_kl(q_proxy, k_proxy, q, k, lse, scale, proxy_scale=None):
    """(lse_proxy, kl_rows) of warmup over a dense main attention's lse: the dense KL kernels where built, else the
    sparse KL pass with every causal block selected."""
    if _warmup_tuning(q).dense_proxy and warmup_kl.usable(q_proxy, q) is None:
        return warmup_kl.warmup_kl_cuda(q_proxy, k_proxy, q, k, lse, scale, proxy_scale)
    block_size = _warmup_block(q)
    return sparse_fwd.msa_kl_cuda(q_proxy, k_proxy, q, k, lse, AllCausalBlocks(q_proxy, block_size), block_size,
                                  scale, proxy_scale=proxy_scale)


def _warmup_kl(q_proxy, k_proxy, q, k, v, lse, scale, cu_seqlens=None, *, with_kl=True, proxy_scale=None):
    """warmup_forward's KL pass alone, on the route its forward took (the same kernels, so the same lse_proxy).
    with_kl False: lse_proxy is what is asked for (kl_rows may be zeros): the dense proxy lse alone where built."""
    assert cu_seqlens is None, "packed.per_sequence passes one sequence at a time"
    if not _warmup_fits(q_proxy, q):
        return reference_impl("warmup_kl")(q_proxy, k_proxy, q, k, v, lse, scale, cu_seqlens,
                                           proxy_scale=proxy_scale)
    q_proxy, k_proxy = _proxy_at(q_proxy, k_proxy, q.shape[3])
    if not _dense_main(q):
        return _msa_kl(q_proxy, k_proxy, q, k, v, lse, *_warmup_selection(q_proxy, q), scale,
                       proxy_scale=proxy_scale)
    if not with_kl and _warmup_tuning(q).dense_proxy and warmup_kl.usable(q_proxy, q, "warmup_lse") is None:
        lse_proxy = warmup_kl.warmup_lse_cuda(_tma_ready(q_proxy), _tma_ready(k_proxy),
                                              scale if proxy_scale is None else proxy_scale)
        return lse_proxy, torch.zeros_like(lse_proxy)
    return _dense_warmup_kl(*(_tma_ready(t) for t in (q_proxy, k_proxy, q, k)), lse, scale, proxy_scale)


def _warmup_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, cu_seqlens=None,
                     kl_metric=None, proxy_scale=None, kl_rows_out=None):
    """kl_metric: also the mean KL value into it (deferred mode): from the proxy backward where its kl_value
    variant runs this problem, else from the KL pass. kl_rows_out: as _msa_backward's."""
    assert cu_seqlens is None, "packed.per_sequence passes one sequence at a time"
    wanted = kl_metric is not None or kl_rows_out is not None
    if not _warmup_fits(q_proxy, q):
        if kl_rows_out is not None:  # the reference forms the rows by its forward again, as it does for a metric
            kl_rows_out.append(reference_impl("warmup_kl")(q_proxy, k_proxy, q, k, v, lse, scale,
                                                           proxy_scale=proxy_scale)[1])
        return reference_impl("warmup_backward")(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale,
                                                 grad_out, kl_grad, cu_seqlens, kl_metric=kl_metric,
                                                 proxy_scale=proxy_scale)
    kl_rows = [] if wanted else None  # the backward appends the rows when it forms them
    grads = _warmup_backward_at_d(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad,
                                  kl_rows, proxy_scale)
    if wanted:
        rows = kl_rows[0] if kl_rows else _warmup_kl(q_proxy, k_proxy, q, k, v, lse, scale,
                                                     proxy_scale=proxy_scale)[1]
        _kl_value_out(rows, kl_metric, kl_rows_out)
    return _proxy_grads(grads, q_proxy, k_proxy, q.shape[3])


def _warmup_backward_at_d(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, scale, grad_out, kl_grad, kl_rows=None,
                          proxy_scale=None):
    """_warmup_backward with the proxy at D (_proxy_at); its proxy gradients are D wide. kl_rows: a list that
    receives the KL rows where the dense proxy backward forms them (else it stays empty)."""
    q_proxy, k_proxy = _proxy_at(q_proxy, k_proxy, q.shape[3])
    if not _dense_main(q):
        return _msa_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, *_warmup_selection(q_proxy, q),
                             scale, grad_out, kl_grad, proxy_scale=proxy_scale)
    q_proxy, k_proxy, q, k, v = (_tma_ready(t) for t in (q_proxy, k_proxy, q, k, v))
    if grad_out is not None:
        try:
            dq, dk, dv = dense_main.dense_backward(q, k, v, out, lse, grad_out, scale)
        except RuntimeError as e:  # out and lse are exact whichever path made them: the sparse backward takes them
            _cudnn_refused(q, e)
            return _msa_backward(q_proxy, k_proxy, q, k, v, out, lse, lse_proxy, *_warmup_selection(q_proxy, q),
                                 scale, grad_out, kl_grad, proxy_scale=proxy_scale)
    else:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if kl_grad is not None and _warmup_tuning(q).dense_proxy and \
            warmup_kl.usable(q_proxy, q, "warmup_bwd_proxy") is None:
        if kl_rows is not None and warmup_kl.usable(q_proxy, q, "warmup_bwd_proxy_kl") is None:
            B, S, Hp, _ = q_proxy.shape
            kl_rows.append(torch.empty((B, Hp, S), dtype=torch.float32, device=q.device))
        dq_proxy, dk_proxy = warmup_kl.warmup_proxy_backward_cuda(q_proxy, k_proxy, q, k, lse, lse_proxy, scale,
                                                                  kl_grad, kl_rows[0] if kl_rows else None,
                                                                  proxy_scale=proxy_scale)
    elif kl_grad is not None:
        block_size = _warmup_block(q)
        dq_proxy, dk_proxy = sparse_bwd.proxy_backward_cuda(q_proxy, k_proxy, q, k, lse, lse_proxy,
                                                            AllCausalBlocks(q_proxy, block_size), block_size,
                                                            scale, kl_grad, proxy_scale=proxy_scale)
    else:
        dq_proxy, dk_proxy = torch.zeros_like(q_proxy), torch.zeros_like(k_proxy)
    return dq_proxy, dk_proxy, dq, dk, dv


def _warmup_supports(problem: Problem) -> str | None:
    if problem.op == "warmup_backward" and problem.config.get("deterministic"):
        return _decline_deterministic("warmup's backward (cuDNN's dense backward, the proxy kernels) adds with fp32 "
                                      "atomics")
    op = "msa_forward" if problem.op == "warmup_forward" else "msa_backward"
    c = dict(problem.config, block_size=kernel_block_size(problem.config.get("head_dim"), WARMUP_BLOCK))
    return _msa_supports(Problem(op, problem.device, problem.dtype, c))


def _block_sparse_supports(problem: Problem) -> str | None:
    """block_sparse_forward / backward: the MSA main kernels with G = H / lcm(Hi, Hk) (block_sparse.kernel_group);
    the backward adds with fp32 atomics, so under deterministic algorithms it is declined to the reference."""
    c = problem.config
    if problem.op == "block_sparse_backward" and c.get("deterministic"):
        return _decline_deterministic("the block-sparse backward kernel adds with fp32 atomics")
    if problem.dtype not in _DTYPE_NAMES:
        return f"dtype {problem.dtype} (block-sparse kernels: bfloat16, float16)"
    d, bs, H, Hi = (c.get(n) for n in ("head_dim", "block_size", "heads", "index_heads"))
    Hk = H // c.get("kv_group")
    g = block_sparse.kernel_group(H, Hk, Hi)
    limits = _sparse_limits(problem, d, bs, g)
    if limits:
        return f"G = H / lcm(Hi, Hk) = {H} / lcm({Hi}, {Hk}) = {g}; {limits}"
    return _built(problem, block_sparse.variants(_DTYPE_NAMES[problem.dtype], d, kernel_block_size(d, bs), g,
                                                 _arch(problem),
                                                 backward=problem.op == "block_sparse_backward"))


def _check_index_range(block_indices, S: int, block_size: int, fn: str) -> None:
    """msa-semantics.md: "indices outside [0, ceil(S / Bs)) are an error". The check is the reference's, which
    reads one flag on the host; under CUDA graph capture no host read is possible, so there it is skipped and an
    out-of-range index poisons the outputs with NaN instead (_block_sparse_forward). The kernels never read past
    the selection either way: an index above the query's own block is a dead slot, as -1 is."""
    if not torch.cuda.is_current_stream_capturing():
        from flash_msa_rt.reference import checks

        checks.block_indices(fn, block_indices, block_indices.shape[0], S, block_indices.shape[1], block_size)


def _out_of_range(block_indices, S: int, block_size: int):
    """0-dim bool on the device: some index is outside [-1, ceil(S / block_size)) (under capture only)."""
    nb = -(-S // block_size)
    return ((block_indices < -1) | (block_indices >= nb)).any()


def _block_sparse_forward(q, k, v, block_indices, block_size, scale, cu_seqlens=None):
    assert cu_seqlens is None, "packed.per_sequence passes one sequence at a time"
    S = q.shape[1]
    _check_index_range(block_indices, S, block_size, "block_sparse_attention")
    q, k, v = (_tma_ready(t) for t in (q, k, v))
    split, kbs = block_split.kernel_selection(block_indices, block_size, q.shape[3], k.shape[1])
    out, lse = block_sparse.block_sparse_forward_cuda(q, k, v, split, kbs, scale)
    if torch.cuda.is_current_stream_capturing():
        bad = _out_of_range(block_indices, S, block_size)
        nan = torch.full((), float("nan"), device=q.device)
        out, lse = torch.where(bad, nan.to(out.dtype), out), torch.where(bad, nan, lse)
    return out, lse


def _block_sparse_backward(q, k, v, out, lse, block_indices, block_size, scale, grad_out, cu_seqlens=None):
    assert cu_seqlens is None, "packed.per_sequence passes one sequence at a time"
    q, k, v, out = (_tma_ready(t) for t in (q, k, v, out))
    grad_out = _tma_ready(grad_out) if grad_out is not None else None
    block_indices, block_size = block_split.kernel_selection(block_indices, block_size, q.shape[3], k.shape[1])
    return block_sparse.block_sparse_backward_cuda(q, k, v, out, lse, block_indices, block_size, scale, grad_out)


def _as_forward(supports, op: str):
    """The KL pass alone runs where its forward runs (the forward's variants include the KL pass's)."""
    return lambda problem: supports(Problem(op, problem.device, problem.dtype, problem.config))


_SUPPORTS = {"select_blocks": _select_supports, "msa_forward": _msa_supports, "msa_backward": _msa_supports,
             "msa_kl": _as_forward(_msa_supports, "msa_forward"), "warmup_forward": _warmup_supports,
             "warmup_backward": _warmup_supports, "warmup_kl": _as_forward(_warmup_supports, "warmup_forward"),
             "block_sparse_forward": _block_sparse_supports, "block_sparse_backward": _block_sparse_supports}


def _supports(problem: Problem) -> str | None:
    """The op's verdict; a device without a usable arch or artifacts (the loader's error) declines with it."""
    if problem.op not in _SUPPORTS:
        return "its kernel is not built yet"
    try:
        return _SUPPORTS[problem.op](problem)
    except FlashMsaError as e:
        return str(e)


KERNELS = Backend(
    name="kernels", device_type="cuda", supports=_supports,
    ops={op: packed.per_sequence(op, fn, reference_impl(op)) for op, fn in (
        ("select_blocks", _select_blocks), ("msa_forward", _msa_forward), ("msa_backward", _msa_backward),
        ("msa_kl", _msa_kl), ("warmup_forward", _warmup_forward), ("warmup_backward", _warmup_backward),
        ("warmup_kl", _warmup_kl), ("block_sparse_forward", _block_sparse_forward),
        ("block_sparse_backward", _block_sparse_backward))},
)


def reset_warnings() -> None:
    """Re-arm this backend's once-per-process warnings (deterministic mode's fallback) and forget the devices whose
    cuDNN refused warmup's attention (each says so once); flash_msa_rt.ops.dispatch.reset_warnings calls it."""
    global _warned_deterministic
    _warned_deterministic = False
    _cudnn_failed.clear()
