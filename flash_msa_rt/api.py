"""Public MSA API with the published flash-msa 0.1.1 signatures: switching is one import.

    from flash_msa_rt import flash_msa_func, flash_msa_warmup_func
    out, kl_loss = flash_msa_func(q_proxy, k_proxy, q, k, v, top_k=2048)      # (B, heads, S, D) inputs
    loss = lm_loss(out) + 0.1 * kl_loss                                       # kl_loss trains the proxy only

Inputs are (B, heads, S, D) ("bhsd", the default) or (B, S, heads, D) (layout="bshd"); the runtime works in
(B, S, heads, D) and takes the other layout as a free transposed view. Semantics: docs/msa-semantics.md.
The fixed-length path never synchronises the host with the device; the varlen paths (cu_seqlens, document_list,
the *_varlen_func entry points) read the offsets once on the host to validate them, except under CUDA graph
capture, where the ops plan the pack on the device from max_seqlen (seqlen for flash_msa_func) and the checks run
there too, bad offsets making the outputs NaN. Eager calls run the op bodies
from one autograd.Function (flash_msa_rt.ops.eager: the host time of a small step); under torch.compile, export,
fake tensors or any tracing they run as the torch.library custom ops (flash_msa_rt.ops.library).
"""

from __future__ import annotations

import torch

from flash_msa_rt import tuning as _tuning
from flash_msa_rt.ops import eager as _eager
from flash_msa_rt.ops import layout as _layout
from flash_msa_rt.ops import library as _ops
from flash_msa_rt.ops import offsets as _offsets
from flash_msa_rt.ops import validation as _v
from flash_msa_rt.ops.options import MsaOptions

__all__ = ["flash_msa_func", "flash_msa_warmup_func", "flash_msa_func_warmup", "flash_msa_varlen_func",
           "flash_msa_warmup_varlen_func", "block_sparse_attention", "select_blocks"]

_MSA_NAMES = ("q_proxy", "k_proxy", "q", "k", "v")


def flash_msa_func(q_proxy, k_proxy, q, k, v, top_k, scale=None, document_list=None, *, cu_seqlens=None,
                   kl_metric=None, layout="bhsd", block_size=128, kl_value="exact", select_precision="bf16",
                   sinks=None, proxy_scale=None, local_blocks=1):
    """MiniMax Sparse Attention: proxy top-K block selection, sparse causal attention and the proxy KL loss.

    q_proxy (B, Hp, S, Dp), k_proxy (B, Hpk, S, Dp), q (B, H, S, D), k and v (B, Hk, S, D) for layout="bhsd";
    (B, S, heads, D) each for layout="bshd". One dtype for all five (bfloat16, float16, float32; float64 on the
    reference), one device, unit-stride head dims, H % Hk == 0, Hp % Hpk == 0, H % Hp == 0.

    top_k: selected tokens per query, a positive multiple of block_size; K = top_k // block_size blocks, the
    query's own block included (K above the number of blocks is fine: the extra slots stay empty).
    scale: softmax scale of proxy and main scores, default D ** -0.5.
    document_list: optional (B, S) integer document ids; each maximal run of one id in a row is an independent
    sequence. Converting it to offsets synchronises the host with the device.
    cu_seqlens: optional int32 offsets over the flattened B * S tokens (0, ..., B * S, non-decreasing, containing
    every multiple of S); each segment is an independent sequence (causal within it, blocks aligned to its start).
    Validating it synchronises. At most one of document_list and cu_seqlens.
    kl_metric: optional 0-dim float32 tensor on q's device that receives the KL value (published compatibility).
    kl_value: "exact" (default): kl_loss holds the KL after the forward (and kl_metric too). "deferred": the
    forward skips the KL pass, kl_loss's value is 0 (its gradient unchanged) and the backward writes the exact KL
    into kl_metric, on the device; with no backward (no_grad, inputs without grad) a given kl_metric makes the call
    "exact". "none": no KL value at all (kl_metric must be None). Gradients are the same in every mode.
    select_precision: "bf16" (default): blocks are ranked by the proxy scores in the inputs' precision. "fp8":
    ranked by scores of q_proxy (per token) and k_proxy (per key block) quantised to float8 e4m3 with power-of-two
    scales, accumulated in float32 (about twice the selection rate on Hopper; docs/msa-semantics.md, "FP8
    selection"). Only the ranking changes: the KL, its gradients and the main attention use the unquantised inputs.
    sinks: optional float32 (H,) tensor on q's device, one learned sink logit per main head (gpt-oss; usually an
    nn.Parameter, its gradient flows): an extra softmax term with no value. The KL target ignores it.
    proxy_scale: the scale of the proxy scores in the KL and its gradient (None: scale; MiniMax-M3's indexer: 1.0).
    The selection's ranking does not depend on it.
    local_blocks: the L most recent blocks every query always selects (its own and the L - 1 before it), 1 <= L <= K.

    Returns (out (B, S, H * D) in q's dtype, kl_loss): kl_loss is a 0-dim float32 tensor (float64 for float64
    inputs) holding the true KL, mean over (b, p, i) of KL(tau || pi); its gradient reaches q_proxy and k_proxy
    only, scaled by whatever multiplies it in the loss (read on the device: no host synchronisation).
    """
    return _msa("flash_msa_func", True, q_proxy, k_proxy, q, k, v, top_k, scale, document_list, cu_seqlens,
                kl_metric, layout, block_size, kl_value, select_precision, sinks, proxy_scale, local_blocks)


def flash_msa_warmup_func(q_proxy, k_proxy, q, k, v, top_k, scale=None, document_list=None, *, cu_seqlens=None,
                          kl_metric=None, layout="bhsd", block_size=128, kl_value="exact", sinks=None,
                          proxy_scale=None, local_blocks=1):
    """Warmup mode of flash_msa_func: dense causal main attention, the proxy trained by the KL over every causal key.

    Same arguments and returns as flash_msa_func. top_k, block_size and local_blocks are validated for
    compatibility (a model switches modes with the same arguments) and otherwise unused (no selection happens in
    warmup); sinks and proxy_scale apply as there.
    """
    return _msa("flash_msa_warmup_func", False, q_proxy, k_proxy, q, k, v, top_k, scale, document_list, cu_seqlens,
                kl_metric, layout, block_size, kl_value, "bf16", sinks, proxy_scale, local_blocks)


flash_msa_func_warmup = flash_msa_warmup_func  # the published alias


def flash_msa_varlen_func(q_proxy, k_proxy, q, k, v, cu_seqlens, max_seqlen, top_k, scale=None, *, block_size=128,
                          kl_metric=None, cu_seqlens_k=None, max_seqlen_k=None, seqused_k=None, kl_value="exact",
                          select_precision="bf16", sinks=None, proxy_scale=None, local_blocks=1):
    """flash_msa_func over packed sequences, FlashAttention varlen style.

    q_proxy (total, Hp, Dp), k_proxy (total, Hpk, Dp), q (total, H, D), k and v (total, Hk, D); cu_seqlens int32
    (num_seqs + 1,) from 0 to total, non-decreasing (empty sequences allowed); max_seqlen >= the longest sequence.
    Validating cu_seqlens synchronises the host with the device. Returns (out (total, H, D), kl_loss), kl_loss the
    sum of per-row KL over (p, token) divided by Hp * total.

    Separate query and key lengths (FlashAttention's cu_seqlens_q / cu_seqlens_k): with cu_seqlens_k (int32,
    num_seqs + 1, from 0 to total_k, non-decreasing) and max_seqlen_k (>= the longest key sequence), cu_seqlens
    and max_seqlen describe the queries, q_proxy and q (total_q, heads, D), and cu_seqlens_k the keys, k_proxy, k
    and v (total_k, heads, D). Sequence s has L_q <= L_k and its queries are the last L_q of its L_k positions
    (bottom-right causal alignment): a query chunk attends to, selects from and trains its proxy against the whole
    key prefix before it. kl_loss divides by Hp * total_q. seqused_k (int32 (num_seqs,), with cu_seqlens_k):
    sequence s reads the L_k = seqused_k[s] keys from cu_seqlens_k[s] on, so key ranges may overlap: one rank's
    two zigzag chunks of a sequence are two query sequences over one gathered key tensor, without a copy
    (docs/msa-semantics.md); key gradients sum over every sequence that reads a key. Separate key lengths run on
    the reference (the kernels take a sequence's queries and keys alike). kl_value, select_precision, sinks,
    proxy_scale and local_blocks as flash_msa_func's (fp8 key blocks restart at each sequence's key start).
    """
    return _msa_varlen("flash_msa_varlen_func", True, q_proxy, k_proxy, q, k, v, cu_seqlens, max_seqlen, top_k,
                       scale, block_size, kl_metric, cu_seqlens_k, max_seqlen_k, seqused_k, kl_value, select_precision,
                       sinks, proxy_scale, local_blocks)


def flash_msa_warmup_varlen_func(q_proxy, k_proxy, q, k, v, cu_seqlens, max_seqlen, top_k, scale=None, *,
                                 block_size=128, kl_metric=None, cu_seqlens_k=None, max_seqlen_k=None,
                                 seqused_k=None, kl_value="exact", sinks=None, proxy_scale=None, local_blocks=1):
    """Warmup mode of flash_msa_varlen_func (dense causal per sequence; top_k and local_blocks validated, unused);
    cu_seqlens_k, max_seqlen_k, seqused_k, kl_value, sinks and proxy_scale as there."""
    return _msa_varlen("flash_msa_warmup_varlen_func", False, q_proxy, k_proxy, q, k, v, cu_seqlens, max_seqlen,
                       top_k, scale, block_size, kl_metric, cu_seqlens_k, max_seqlen_k, seqused_k, kl_value, "bf16",
                       sinks, proxy_scale, local_blocks)


def block_sparse_attention(q, k, v, block_indices, block_size=128, scale=None, *, layout="bhsd", return_lse=False,
                           cu_seqlens=None, sinks=None):
    """Causal attention of each query over the key blocks listed for it (NSA / FSA selected attention).

    q (B, H, S, D), k and v (B, Hk, S, D) ("bhsd"; (B, S, heads, D) for "bshd"); block_indices int32
    (B, Hi, S, K) in either layout, -1 for empty slots, index head i serving query heads [i * H / Hi, (i + 1) * H / Hi).
    Duplicate indices count once; a row with no allowed key gets out = 0 and lse = -inf; indices outside
    [0, ceil(S / block_size)) raise. Returns out in q's layout and dtype, and with return_lse also lse (B, H, S)
    float32 (not differentiable).

    On the GPU this runs the MSA sparse kernels (bfloat16 / float16, D in {64, 128, 256}, block_size in {64, 128},
    H / lcm(Hi, Hk) in {1, 2, 4, 8, 16}, where the installed artifacts hold that configuration: docs/matrix.md;
    anything else runs on the reference and says why once, naming the build command where one would serve).
    Checking the index range reads one flag on the host (a synchronisation); under CUDA graph capture that read is
    skipped and an out-of-range index makes the output NaN instead of raising.

    cu_seqlens: optional int32 (num_seqs + 1,) offsets of packed sequences along S of a batch of one row (B = 1;
    0, ..., S, non-decreasing): each sequence is causal within itself and an index j of one of its queries names
    block j of that sequence (its keys start + j * block_size onward). Validating it synchronises the host.

    sinks: optional float32 (H,) sink logits (as flash_msa_func's): lse includes them, and a row with no allowed
    key then gets out = 0 and lse = sink[h].
    """
    fn = "block_sparse_attention"
    _v.check_layout(fn, layout)
    dims_text = _v.LAYOUTS[layout]
    for name, t in (("q", q), ("k", k), ("v", v)):
        _v.check_tensor(fn, name, t, 4, dims_text)
    _v.check_same_dtype_device(fn, {"q": q, "k": k, "v": v})
    q, k, v = (_layout.to_bshd(t, layout) for t in (q, k, v))
    _check_seqlen_in_layout(fn, layout, {"q": q, "k": k, "v": v})
    B, S, H, D = q.shape
    for name, t in (("k", k), ("v", v)):
        for i, what in ((0, "batch"), (3, "head_dim")):
            if t.shape[i] != q.shape[i]:
                raise ValueError(f"{fn}: {name} has {what} {t.shape[i]} but q has {what} {q.shape[i]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}: v has {v.shape[2]} heads but k has {k.shape[2]}; k and v must have the same heads")
    if S < 1 or H < 1 or D < 1 or k.shape[2] < 1:
        raise ValueError(f"{fn}: q and k must have positive seqlen, heads and head_dim, got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)} as (batch, seqlen, heads, head_dim)")
    if H % k.shape[2]:
        raise ValueError(f"{fn}: q has {H} heads, not a multiple of the {k.shape[2]} heads of k and v")
    block_size = _v.check_block_size(fn, block_size)
    _v.check_block_indices(fn, block_indices, B, S, H, q.device)
    scale = _v.resolve_scale(fn, scale, D)
    sinks = _v.check_sinks(fn, sinks, H, q.device)
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{fn}: cu_seqlens packs sequences along S of a batch of one row, but q has batch {B}; "
                             f"put the sequences one after another in a (1, total, ...) tensor")
        _v.check_cu_seqlens(fn, cu_seqlens, q.device)
        if _offsets.capturing(cu_seqlens):
            raise NotImplementedError(f"{fn}: cu_seqlens under CUDA graph capture is not supported: its packs read "
                                      f"the offsets on the host; capture flash_msa_varlen_func, or run this call "
                                      f"outside the graph")
        if not torch.compiler.is_compiling():  # compiled: the custom op checks them when it runs (library)
            _v.check_cu_seqlens_values(fn, cu_seqlens, S)
    if _eager.usable(q, k, v, block_indices, cu_seqlens, sinks):
        out, lse = _eager.block_sparse(q, k, v, block_indices, block_size, scale, cu_seqlens, sinks)
    else:
        out, lse = _ops.block_sparse_forward(q, k, v, block_indices, block_size, scale, cu_seqlens, sinks)
    out = _layout.from_bshd(out, layout)
    return (out, lse) if return_lse else out


def select_blocks(q_proxy, k_proxy, top_k, scale=None, *, layout="bhsd", block_size=128, select_precision="bf16",
                  proxy_scale=None, local_blocks=1):
    """The blocks MSA selects: int32 (B, Hp, S, K), K = top_k // block_size, ascending per row with -1 last.

    q_proxy (B, Hp, S, Dp), k_proxy (B, Hpk, S, Dp) ("bhsd"; "bshd" as flash_msa_func). scale defaults to
    Dp ** -0.5; the selection does not depend on it (top-K of scaled scores) except through rounding. No gradient.
    proxy_scale: as flash_msa_func's, the scale the proxy scores are ranked with (None: scale); the same blocks up
    to rounding. select_precision and local_blocks as flash_msa_func's.
    """
    fn = "select_blocks"
    select_precision = _v.check_select_precision(fn, select_precision)
    _v.check_layout(fn, layout)
    for name, t in (("q_proxy", q_proxy), ("k_proxy", k_proxy)):
        _v.check_tensor(fn, name, t, 4, _v.LAYOUTS[layout])
    _v.check_same_dtype_device(fn, {"q_proxy": q_proxy, "k_proxy": k_proxy})
    q_proxy, k_proxy = _layout.to_bshd(q_proxy, layout), _layout.to_bshd(k_proxy, layout)
    _check_seqlen_in_layout(fn, layout, {"q_proxy": q_proxy, "k_proxy": k_proxy})
    _v.check_proxy_dims(fn, q_proxy, k_proxy)
    block_size = _v.check_block_size(fn, block_size)
    K = _v.check_top_k(fn, top_k, block_size)
    local_blocks = _v.check_local_blocks(fn, local_blocks, K)
    scale = _v.resolve_scale(fn, scale, q_proxy.shape[-1])
    proxy_scale = _v.resolve_proxy_scale(fn, proxy_scale, scale)
    scale = scale if proxy_scale is None else proxy_scale
    select = _ops.select_blocks_body if _eager.usable(q_proxy, k_proxy) else _ops.select_blocks  # no gradient
    return select(q_proxy.detach(), k_proxy.detach(), K, block_size, scale, None, None, None, select_precision,
                  local_blocks)


# --- shared bodies -------------------------------------------------------------------------------------------------

def _check_seqlen_in_layout(fn, layout, views):
    """Every (B, S, heads, D) view has q's seqlen; else say how `layout` read the tensors, since the usual cause
    is (B, heads, S, D) tensors passed with layout="bshd" (or the reverse): their heads then read as seqlen."""
    (first, ref), *rest = views.items()
    for name, t in rest:
        if t.shape[1] != ref.shape[1]:
            other = "bhsd" if layout == "bshd" else "bshd"
            raise ValueError(
                f"{fn}: {name} has seqlen {t.shape[1]} but {first} has seqlen {ref.shape[1]}, reading the tensors "
                f"as {_v.LAYOUTS[layout]} (layout={layout!r}); if they are {_v.LAYOUTS[other]}, pass "
                f"layout={other!r}")


def _check_five(fn, tensors, ndim, dims_text):
    for name, t in zip(_MSA_NAMES, tensors):
        _v.check_tensor(fn, name, t, ndim, dims_text)
    _v.check_same_dtype_device(fn, dict(zip(_MSA_NAMES, tensors)))


def _options(fn, sparse, dims, device, top_k, scale, block_size, kl_value, kl_metric, select_precision, sinks,
             proxy_scale, local_blocks) -> MsaOptions:
    """Every option of an MSA call validated (errors name the argument, its value and what is supported), as the
    one frozen object the layers below take; offsets and the KL route are added by the caller."""
    kl_value = _v.check_kl_value(fn, kl_value, kl_metric)
    select_precision = _v.check_select_precision(fn, select_precision)
    block_size = _v.check_block_size(fn, block_size)
    K = _v.check_top_k(fn, top_k, block_size)
    scale = _v.resolve_scale(fn, scale, dims.D)
    _v.check_kl_metric(fn, kl_metric, device)
    return MsaOptions(sparse=sparse, K=K, block_size=block_size, scale=scale,
                      proxy_scale=_v.resolve_proxy_scale(fn, proxy_scale, scale),
                      local_blocks=_v.check_local_blocks(fn, local_blocks, K),
                      sinks=_v.check_sinks(fn, sinks, dims.H, device), select_precision=select_precision,
                      kl_value=kl_value, kl_metric=kl_metric)


def _msa(fn, sparse, q_proxy, k_proxy, q, k, v, top_k, scale, document_list, cu_seqlens, kl_metric, layout,
         block_size, kl_value, select_precision="bf16", sinks=None, proxy_scale=None, local_blocks=1):
    _v.check_kl_value(fn, kl_value, kl_metric)
    _v.check_layout(fn, layout)
    _check_five(fn, (q_proxy, k_proxy, q, k, v), 4, _v.LAYOUTS[layout])
    q_proxy, k_proxy, q, k, v = (_layout.to_bshd(t, layout) for t in (q_proxy, k_proxy, q, k, v))
    _check_seqlen_in_layout(fn, layout, {"q": q, "q_proxy": q_proxy, "k_proxy": k_proxy, "k": k, "v": v})
    dims = _v.check_msa_dims(fn, q_proxy, k_proxy, q, k, v)
    device = q.device
    opts = _options(fn, sparse, dims, device, top_k, scale, block_size, kl_value, kl_metric, select_precision, sinks,
                    proxy_scale, local_blocks)
    if document_list is not None and cu_seqlens is not None:
        raise ValueError(f"{fn}: pass document_list or cu_seqlens, not both")
    if document_list is not None:
        if torch.compiler.is_compiling() or device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(f"{fn}: document_list under CUDA graph capture or torch.compile is not "
                                      f"supported: turning it into offsets reads the number of documents on the "
                                      f"host; pass cu_seqlens (or use flash_msa_varlen_func) in a captured or "
                                      f"compiled step")
        _v.check_document_list(fn, document_list, dims.B, dims.S, device)
        cu_seqlens = _layout.cu_seqlens_from_document_list(document_list)
    invalid = bound = None
    if cu_seqlens is not None:
        _v.check_cu_seqlens(fn, cu_seqlens, device)
        if _offsets.planned_on_device(cu_seqlens):  # each sequence lies within a row: seqlen bounds it
            invalid, bound = _captured_offsets(fn, cu_seqlens, dims.B * dims.S, dims.S, False, row_len=dims.S), dims.S
        else:
            _v.check_cu_seqlens_values(fn, cu_seqlens, dims.B * dims.S, row_len=dims.S)
        # batch rows become consecutive packed sequences of one row
        q_proxy, k_proxy, q, k, v = (_layout.flatten_batch(t) for t in (q_proxy, k_proxy, q, k, v))
    out, kl_loss = _run(q_proxy, k_proxy, q, k, v, opts.replace(cu_seqlens=cu_seqlens, max_seqlen=bound))
    out = out.reshape(dims.B, dims.S, dims.H * dims.D)
    return (out, kl_loss) if invalid is None else (_poisoned(out, invalid), _poisoned(kl_loss, invalid))


def _captured_offsets(fn, cu_seqlens, total, max_seqlen, separate, row_len=None):
    """Offsets under CUDA graph capture or torch.compile, where nothing is read on the host and a replay (or the
    next call of the compiled graph) may bring new values: the ops plan the pack on the device from max_seqlen
    (flash_msa_rt.ops.packed, _DevicePadded), and the checks the host makes otherwise run on the device. Returns
    their 0-dim bool verdict. Under capture the eager path's ops find max_seqlen declared beside the offsets; under
    torch.compile the custom ops take it as their max_seqlen argument (_run), since no Python state of this call
    reaches the compiled graph."""
    if separate and not torch.compiler.is_compiling():
        raise NotImplementedError(f"{fn}: cu_seqlens_k under CUDA graph capture is not supported: separate key "
                                  f"offsets run on the reference, which reads them on the host; capture without "
                                  f"cu_seqlens_k, or run this call outside the graph")
    _v.check_max_seqlen(fn, max_seqlen, 0)
    if not torch.compiler.is_compiling():
        _offsets.declare_max_seqlen(cu_seqlens, max_seqlen)
    return _offsets.invalid_on_device(cu_seqlens, total, max_seqlen, row_len)


def _poisoned(t, invalid):
    """t, NaN everywhere where the captured offsets broke the contract (the check that raises outside capture);
    an addition, so gradients pass through unchanged."""
    return t + torch.where(invalid, float("nan"), 0.0).to(t.dtype)


def _msa_varlen(fn, sparse, q_proxy, k_proxy, q, k, v, cu_seqlens, max_seqlen, top_k, scale, block_size, kl_metric,
                cu_seqlens_k=None, max_seqlen_k=None, seqused_k=None, kl_value="exact", select_precision="bf16",
                sinks=None, proxy_scale=None, local_blocks=1):
    _v.check_kl_value(fn, kl_value, kl_metric)
    _v.check_select_precision(fn, select_precision)
    separate = cu_seqlens_k is not None
    if not separate:
        for name, value in (("max_seqlen_k", max_seqlen_k), ("seqused_k", seqused_k)):
            if value is not None:
                shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
                raise ValueError(f"{fn}: {name} is {shown} but cu_seqlens_k is None; {name} is supported with "
                                 f"cu_seqlens_k only (without it, cu_seqlens and max_seqlen describe queries and keys "
                                 f"alike)")
    elif max_seqlen_k is None:
        raise ValueError(f"{fn}: cu_seqlens_k is given but max_seqlen_k is None; pass max_seqlen_k >= the longest "
                         f"key sequence (as max_seqlen for the queries)")
    _check_five(fn, (q_proxy, k_proxy, q, k, v), 3, "(total_tokens, heads, head_dim)")
    q_proxy, k_proxy, q, k, v = (t.unsqueeze(0) for t in (q_proxy, k_proxy, q, k, v))
    dims = _v.check_msa_dims(fn, q_proxy, k_proxy, q, k, v, seq_dim_name="total_tokens", separate_keys=separate)
    opts = _options(fn, sparse, dims, q.device, top_k, scale, block_size, kl_value, kl_metric, select_precision,
                    sinks, proxy_scale, local_blocks)
    _v.check_cu_seqlens(fn, cu_seqlens, q.device)
    if _offsets.planned_on_device(cu_seqlens):  # no host read: checked on the device, the outputs NaN if it fails
        invalid = _captured_offsets(fn, cu_seqlens, dims.S, max_seqlen, separate)
        if separate:  # torch.compile only: the ops read the key offsets themselves (packed._separate_keys)
            invalid = invalid | _compiled_key_offsets(fn, cu_seqlens, cu_seqlens_k, max_seqlen_k, seqused_k,
                                                      k.shape[1], q.device)
        out, kl_loss = _run(q_proxy, k_proxy, q, k, v,
                            opts.replace(cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                                         max_seqlen=None if separate else max_seqlen))
        return _poisoned(out[0], invalid), _poisoned(kl_loss, invalid)
    longest = _v.check_cu_seqlens_values(fn, cu_seqlens, dims.S)
    _v.check_max_seqlen(fn, max_seqlen, longest)
    if separate:
        longest_k = _v.check_key_offsets(fn, cu_seqlens, cu_seqlens_k, seqused_k, k.shape[1], q.device)
        _v.check_max_seqlen(fn, max_seqlen_k, longest_k, name="max_seqlen_k",
                            offsets="cu_seqlens_k / seqused_k" if seqused_k is not None else "cu_seqlens_k")
    out, kl_loss = _run(q_proxy, k_proxy, q, k, v,
                        opts.replace(cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k))
    return out[0], kl_loss


def _compiled_key_offsets(fn, cu_seqlens, cu_seqlens_k, max_seqlen_k, seqused_k, total_k, device):
    """Separate key offsets under torch.compile: the host checks of check_key_offsets that read no value (type,
    shape, device), then the rest on the device (0-dim bool verdict)."""
    _v.check_cu_seqlens(fn, cu_seqlens_k, device, name="cu_seqlens_k")
    if cu_seqlens_k.shape[0] != cu_seqlens.shape[0]:
        raise ValueError(f"{fn}: cu_seqlens_k has {cu_seqlens_k.shape[0]} entries but cu_seqlens has "
                         f"{cu_seqlens.shape[0]}; both are (num_seqs + 1,), one entry per sequence boundary")
    if seqused_k is not None:
        _v.check_seqused_k(fn, seqused_k, cu_seqlens.shape[0] - 1, device)
    _v.check_max_seqlen(fn, max_seqlen_k, 0, name="max_seqlen_k")
    return _offsets.keys_invalid_on_device(cu_seqlens, cu_seqlens_k, seqused_k, total_k, max_seqlen_k)


def _kl_route(kl_value: str, kl_metric, tensors, sparse: bool, packed: bool) -> tuple[bool, bool]:
    """(the forward runs the KL pass, kl_loss and kl_metric hold the value after the forward). "exact": both, and
    "deferred" where no backward will run (no_grad or no input needing a gradient) while a kl_metric waits for the
    value (msa-semantics.md, kl_value). Otherwise the value waits for the backward, and so does the pass, except
    where tuning.kl_value has a sparse step's forward run it (small, host-bound steps: the backward then writes
    kl_metric from the forward's rows)."""
    if kl_value == "exact":
        return True, True
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if kl_value == "deferred" and kl_metric is not None and not backward:
        return True, True
    q_proxy, (rows, devices) = tensors[0], _kl_forward_pass_policy()
    B, S, Hp = q_proxy.shape[:3]
    small = q_proxy.device.type in devices and B * Hp * S <= rows
    return sparse and not packed and backward and small, False


@torch.compiler.assume_constant_result
def _kl_forward_pass_policy() -> tuple[int, tuple[str, ...]]:
    """(forward_pass_rows, forward_pass_devices) of tuning.kl_value under the overrides in effect. Dynamo cannot
    trace the overrides' ContextVar, so under torch.compile this runs once, when the graph is traced, and the graph
    keeps that answer (no guard: torch._dynamo.reset() after changing an override). Only where the KL pass runs
    depends on it, never a value or a gradient (tuning.kl_value)."""
    t = _tuning.kl_value.choose()
    return t.forward_pass_rows, t.forward_pass_devices


def _run(q_proxy, k_proxy, q, k, v, opts: MsaOptions):
    """The ops on (B, S, heads, D) views; kl_loss = mean of kl_rows, formed here so its upstream gradient reaches the
    backward as a device tensor (no host read of the loss coefficient). Without the KL pass in the forward, kl_rows
    are zeros (kl_loss's value 0, its gradient unchanged) and the backward writes kl_metric; where the forward runs
    the pass for a value that waits (_kl_route), kl_loss is a zero-valued mean of its rows. opts.max_seqlen: the
    packs' bound where the offsets are planned on the device (the custom ops' argument; the eager path, under
    capture, finds it declared beside the offsets)."""
    # the sinks stay out of the route: the KL does not depend on them, so their gradient alone runs no KL backward
    kl, value_now = _kl_route(opts.kl_value, opts.kl_metric, (q_proxy, k_proxy, q, k, v), opts.sparse,
                              opts.cu_seqlens is not None)
    opts = opts.replace(kl=kl, value_now=value_now)
    offsets = (opts.cu_seqlens, opts.cu_seqlens_k, opts.seqused_k)
    if _eager.usable(q_proxy, k_proxy, q, k, v, opts.kl_metric, opts.sinks, *offsets):
        return _eager.msa(q_proxy, k_proxy, q, k, v, opts)
    deferred_metric = None if value_now else opts.kl_metric
    if opts.sparse:
        block_indices = _ops.select_blocks(q_proxy.detach(), k_proxy.detach(), opts.K, opts.block_size,
                                           opts.selection_scale, *offsets, opts.select_precision, opts.local_blocks,
                                           opts.max_seqlen)
        out, _, _, kl_rows = _ops.msa_forward(q_proxy, k_proxy, q, k, v, block_indices, opts.block_size, opts.scale,
                                              *offsets, kl, deferred_metric, opts.sinks, opts.proxy_scale,
                                              opts.max_seqlen)
    else:
        out, _, _, kl_rows = _ops.warmup_forward(q_proxy, k_proxy, q, k, v, opts.scale, *offsets, kl,
                                                 deferred_metric, opts.sinks, opts.proxy_scale, opts.max_seqlen)
    if kl and not value_now:
        return out, _ZeroValuedMean.apply(kl_rows)
    kl_loss = kl_rows.sum() / max(kl_rows.numel(), 1)
    if opts.kl_metric is not None and value_now:
        opts.kl_metric.copy_(kl_loss.detach())
    return out, kl_loss


class _ZeroValuedMean(torch.autograd.Function):
    """kl_loss where the forward ran the KL pass but the value waits for the backward: 0, with the gradient of the
    rows' mean (what kl_rows.sum() / n passes back: the upstream gradient / n, expanded)."""

    @staticmethod
    def forward(ctx, kl_rows):
        ctx.shape, ctx.n = kl_rows.shape, max(kl_rows.numel(), 1)
        return kl_rows.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return (grad / ctx.n).expand(ctx.shape)
