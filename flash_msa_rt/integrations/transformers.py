"""MiniMax-M3 in transformers (>= 5.23) on flash-msa: its sparse attention, and training its indexer.

    import flash_msa_rt.integrations.transformers as fmt                  # registers attn_implementation="flash_msa"
    model = MiniMaxM3VLForCausalLM.from_pretrained(path, attn_implementation="msa_rt")   # or fmt.use_flash_msa(model)
    msa = fmt.enable_msa_training(model, mode="sparse")                   # or mode="warmup"
    loss = model(input_ids, labels=labels, position_ids=position_ids).loss + kl_coef * msa.kl_loss()

The implementation is registered as "flash_msa" and as "msa_rt", one function: transformers (5.23 to at least
5.25) takes any attn_implementation name containing "flash" for FlashAttention, so from_pretrained /
set_attn_implementation("flash_msa") redirect M3 to its Blackwell hub kernel (MiniMaxAI/msa). Load with "msa_rt",
or call use_flash_msa(model) on a loaded model (it sets the text configs' _attn_implementation to "flash_msa"
directly, past that check).

Two ways in:

- attn_implementation="flash_msa" alone: M3's own indexer selects the blocks (its fp32 (B, heads, S, S) scores
  included) and each sparse layer runs its main attention on block_sparse_attention from those block indices,
  forward and backward; dense layers and anything without block indices run transformers' SDPA. This is the
  model's own computation, for unpacked batches of moderate length (the indexer's slots are absolute, so a packed
  batch selects across documents there, as in transformers' "sdpa" path).
- enable_msa_training(model, ...): each sparse layer's indexer hands its normalised, rotated idx_q / idx_k to the
  attention as the proxy, and the main q / k / v go to flash_msa_func (mode="sparse") or flash_msa_warmup_func
  (mode="warmup"): selection, sparse attention and the indexer's KL in one op, no (S x S) tensor. Packed batches
  (position_ids restarting per document, transformers' flattening collator) become cu_seqlens built on the device,
  one tensor per forward for all sparse layers, which flash_msa_rt's varlen path validates with one host read per
  forward; every document selects only within itself. Under torch.compile or CUDA graph capture use packed=False
  (the offsets cannot be read there, and B * S + 1 of them cannot be planned on the device).

M3 -> flash-msa: q_proxy = idx_q (B, index_n_heads, S, index_head_dim), k_proxy = idx_k (B, 1, S, index_head_dim),
top_k = index_topk_blocks * index_block_size tokens, block_size = index_block_size (64 or 128), index head i
serving query heads [i * H / index_n_heads, (i + 1) * H / index_n_heads) as M3's build_block_mask does. M3 ranks
blocks by unscaled scores; flash-msa by scaled ones: the same ranking (up to rounding: near ties). The proxy's
softmax in the KL uses proxy_scale = index_head_dim ** -0.5 (M3's indexer scale; the main attention keeps
head_dim ** -0.5) and each query always selects its index_local_blocks most recent blocks (local_blocks), both
passed to flash_msa_func / flash_msa_warmup_func (docs/msa-semantics.md); enable_msa_training overrides either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

import flash_msa_rt

__all__ = ["ALIAS", "ATTN_IMPLEMENTATION", "MODES", "IndexerProxy", "MsaTraining", "cu_seqlens_from_position_ids",
           "enable_msa_training", "flash_msa_attention_forward", "indexer_proxy", "register",
           "use_flash_msa"]

ATTN_IMPLEMENTATION = "flash_msa"
ALIAS = "msa_rt"  # the same implementation under a name transformers' loader accepts (the module's docstring)
MODES = ("sparse", "warmup")
KL_VALUES = ("deferred", "exact", "none")
SPARSE_LAYER = "minimax_m3_sparse"  # M3's layer_types entry of a layer with an indexer


# --- the indexer's proxy --------------------------------------------------------------------------------------------

class IndexerProxy(NamedTuple):
    """What a training-mode indexer returns in place of block indices (the attention interface's block_indices
    argument): the proxy queries and keys, and the positions the model gave (documents restart at 0)."""

    idx_q: torch.Tensor  # (B, index_n_heads, S, index_head_dim), RMS-normalised and rotated
    idx_k: torch.Tensor  # (B, 1, S, index_head_dim)
    position_ids: torch.Tensor  # (B, S)


def indexer_proxy(indexer, hidden_states, position_embeddings):
    """idx_q, idx_k exactly as MiniMaxM3VLIndexer.forward forms them before scoring (projection, Gemma RMSNorm,
    partial RoPE over the first cos.shape[-1] channels)."""
    batch, q_len, _ = hidden_states.shape
    idx_q = indexer.q_proj(hidden_states).view(batch, q_len, -1, indexer.head_dim)
    idx_q = indexer.q_norm(idx_q).transpose(1, 2)
    idx_k = indexer.k_proj(hidden_states).view(batch, q_len, 1, indexer.head_dim)
    idx_k = indexer.k_norm(idx_k).transpose(1, 2)
    cos, sin = position_embeddings
    return m3.apply_rotary_pos_emb(idx_q, idx_k, cos[..., :indexer.head_dim], sin[..., :indexer.head_dim])


class _ProxyIndexer(m3.MiniMaxM3VLIndexer):
    """The indexer of a layer in MSA training mode: no scores, no top-k; the selection happens in flash_msa_func
    from the proxy it returns. Installed by swapping the instance's class (parameters and state dict unchanged)."""

    def forward(self, hidden_states, position_embeddings, cache, position_ids):
        if self._flash_msa.detach_indexer_input:  # the KL then trains the indexer's own weights only
            hidden_states = hidden_states.detach()
        idx_q, idx_k = indexer_proxy(self, hidden_states, position_embeddings)
        if cache is not None:  # keep the model's index cache coherent for a later decode
            idx_k = cache.layers[self.layer_idx].update_index(idx_k)
        return IndexerProxy(idx_q, idx_k, position_ids)


# --- packed documents ------------------------------------------------------------------------------------------------

def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 offsets over the flattened B * S tokens where a document starts: every row start, and every token
    whose position is not its predecessor's + 1 (transformers' find_packed_sequence_indices rule). Computed on the
    device with a fixed size B * S + 1 (the trailing entries repeat B * S: empty sequences), so nothing is read on
    the host and the shape does not depend on the data."""
    B, S = position_ids.shape
    total = B * S
    flat = position_ids.reshape(total)
    token = torch.arange(total, device=flat.device)
    follows = torch.zeros_like(token, dtype=torch.bool)
    follows[1:] = flat[1:] == flat[:-1] + 1
    starts_here = ~follows | (token % S == 0)
    starts = torch.where(starts_here, token, total).sort().values
    return torch.cat([starts, starts.new_full((1,), total)]).to(torch.int32)


# --- training mode ---------------------------------------------------------------------------------------------------

@dataclass
class MsaTraining:
    """The handle enable_msa_training returns: settings (mode may change between steps) and the KL outputs."""

    model: torch.nn.Module
    mode: str
    kl_value: str
    proxy_scale: float | None
    local_blocks: int | None
    select_precision: str
    packed: bool
    detach_indexer_input: bool
    previous_attn_implementation: str
    # the last forward's differentiable kl_loss, per sparse layer index
    kl_losses: dict = field(default_factory=dict)
    # per sparse layer, a 0-dim float32 tensor that receives the KL value (after the forward for "exact", after
    # the backward for "deferred"); read it for logging (.item() synchronises)
    kl_metric: dict = field(default_factory=dict)
    # the last position_ids' offsets: (that position_ids, its version, cu_seqlens)
    _offsets: tuple | None = field(default=None, repr=False)

    def offsets(self, position_ids: torch.Tensor) -> torch.Tensor:
        """cu_seqlens of position_ids, one tensor for every sparse layer of a forward: flash_msa_rt validates a
        device tensor's offsets with one host read per tensor and version (flash_msa_rt.ops.offsets), so the
        forward synchronises once, not once per sparse layer (each costing ~1.5 ms of idle device at M3's 64K,
        benchmarks/profile_m3.py). The layers get views of one position_ids (a new tensor object each): the same
        memory, shape and strides with the same version counter (views share it: an in-place write anywhere
        bumps it) is the same position_ids. The kept tensor is held, so no other tensor can take its memory."""
        kept = self._offsets
        version = getattr(position_ids, "_version", None)
        if kept is not None and version is not None and kept[1] == version and _same_view(kept[0], position_ids):
            return kept[2]
        cu = cu_seqlens_from_position_ids(position_ids)
        self._offsets = (position_ids, version, cu)
        return cu

    def kl_loss(self) -> torch.Tensor:
        """The summed kl_loss of the last forward's sparse layers (differentiable; its gradient trains the indexers
        only). With kl_value="deferred" its value is 0: the values arrive in kl_metric with the backward."""
        if not self.kl_losses:
            raise RuntimeError("MsaTraining.kl_loss: no forward has run in MSA training mode yet; call the model "
                               "first")
        return torch.stack([kl.float() for kl in self.kl_losses.values()]).sum()

    def kl_metrics(self) -> dict:
        """{layer index: 0-dim float32 tensor} (no host read; a logger calls .item())."""
        return dict(self.kl_metric)

    def set_mode(self, mode: str) -> None:
        self.mode = _check_choice("MsaTraining.set_mode", "mode", mode, MODES)

    def disable(self) -> None:
        """Restore the model's indexers and its previous attn_implementation."""
        for indexer in _sparse_indexers(self.model):
            indexer.__class__ = m3.MiniMaxM3VLIndexer
            del indexer._flash_msa
        _set_attn_implementation(self.model, self.previous_attn_implementation)


def enable_msa_training(model, mode: str = "sparse", kl_value: str = "deferred", proxy_scale: float | None = None,
                        *, local_blocks: int | None = None, select_precision: str = "bf16",
                        packed: bool = True, detach_indexer_input: bool = True) -> MsaTraining:
    """Switch a MiniMax-M3 model (MiniMaxM3VLForCausalLM, MiniMaxM3VLTextModel or the VL wrapper) to MSA training.

    mode: "sparse" (flash_msa_func: the indexer's top-K blocks, main attention over them) or "warmup"
    (flash_msa_warmup_func: dense main attention, the indexer trained by the KL over every causal key).
    kl_value: flash_msa_func's ("deferred": the backward writes each layer's KL into kl_metric, kl_loss's value 0).
    proxy_scale: the proxy's softmax scale in the KL (flash_msa_func's proxy_scale), default
    index_head_dim ** -0.5. local_blocks: the recent blocks every query selects (flash_msa_func's local_blocks),
    default index_local_blocks. select_precision: "bf16" or "fp8".
    packed: True reads documents from position_ids (restarts), each selecting within itself (one host read of
    the offsets per forward; not under torch.compile or CUDA graph capture, which raise); False treats each row
    as one sequence (no offsets at all, so no host read even for validation).
    detach_indexer_input: True (default) feeds the indexer a detached copy of the layer's hidden states, so the
    KL trains the indexer's weights only and the LM gradients are exactly the model's (DeepSeek-V3.2's lightning
    indexer recipe); False lets the KL's gradient reach the backbone through the indexer's input.
    Returns the MsaTraining handle: loss = lm_loss + coef * handle.kl_loss().
    """
    fn = "enable_msa_training"
    mode = _check_choice(fn, "mode", mode, MODES)
    kl_value = _check_choice(fn, "kl_value", kl_value, KL_VALUES)
    select_precision = _check_choice(fn, "select_precision", select_precision, ("bf16", "fp8"))
    indexers = _sparse_indexers(model)
    if not indexers:
        raise ValueError(f"{fn}: model {type(model).__name__} has no MiniMax-M3 sparse layer (no layer_types entry "
                         f"{SPARSE_LAYER!r} with an indexer); supported: MiniMax-M3 models of transformers")
    if isinstance(indexers[0], _ProxyIndexer):
        raise RuntimeError(f"{fn}: MSA training mode is already enabled on this model; change the mode with "
                           f"handle.set_mode(...) or call handle.disable() first")
    register()
    previous = model.config._attn_implementation
    handle = MsaTraining(model, mode, kl_value, proxy_scale, local_blocks, select_precision, packed,
                          detach_indexer_input, previous)
    for indexer in indexers:
        indexer.__class__ = _ProxyIndexer
        indexer._flash_msa = handle
    _set_attn_implementation(model, ATTN_IMPLEMENTATION)
    return handle


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a is b or (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
                       and a.shape == b.shape and a.stride() == b.stride()))


def _check_choice(fn, name, value, supported):
    if value not in supported:
        raise ValueError(f"{fn}: {name}={value!r} is not supported; supported: {', '.join(map(repr, supported))}")
    return value


def _sparse_indexers(model) -> list:
    return [m for m in model.modules() if isinstance(m, m3.MiniMaxM3VLIndexer)]


def _set_attn_implementation(model, name):
    """On every config of the model directly: transformers' setter sends names containing "flash" to its
    FlashAttention loader (the module's docstring). A VL model's vision tower then runs SDPA through the same
    function (no block indices there)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def use_flash_msa(model):
    """Switch a loaded MiniMax-M3 model to attn_implementation="flash_msa" (the model's own indexer, the main
    attention of sparse layers on block_sparse_attention, SDPA elsewhere). Returns the model."""
    if not _sparse_indexers(model):
        raise ValueError(f"use_flash_msa: model {type(model).__name__} has no MiniMax-M3 sparse layer (no "
                         f"layer_types entry {SPARSE_LAYER!r}); supported: MiniMax-M3 models of transformers")
    register()
    _set_attn_implementation(model, ATTN_IMPLEMENTATION)
    return model


# --- the attention interface -------------------------------------------------------------------------------------

def flash_msa_attention_forward(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                                scaling: float | None = None, block_indices=None, **kwargs):
    """transformers' attention interface for attn_implementation="flash_msa": (B, H, S, D) query, (B, Hk, S, D)
    key / value in; (B, S, H, D) out and no attention weights."""
    if block_indices is None:  # a dense layer (or the vision tower): transformers' SDPA, mask and all
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError(f"flash_msa attention: attention dropout {dropout} is not supported on sparse layers; "
                         f"supported: 0.0 (set config.attention_dropout = 0)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if isinstance(block_indices, IndexerProxy):
        return _msa_training(module, query, key, value, scaling, block_indices), None
    return _selected_attention(module, query, key, value, attention_mask, scaling, block_indices, kwargs), None


def _selected_attention(module, query, key, value, attention_mask, scaling, block_indices, kwargs):
    """The main attention over the blocks M3's indexer chose: block_sparse_attention, whose backward is exact."""
    indexer = module.indexer
    if query.shape[2] != key.shape[2]:
        # decoding over a cache: few queries, so the model's own (queries x keys) block mask is small
        mask = indexer.build_block_mask(block_indices, attention_mask, key.shape[2], query.dtype, query.device,
                                        kwargs.get("position_ids"))
        out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)
        return out
    out = flash_msa_rt.block_sparse_attention(query, key, value, block_indices.to(torch.int32),
                                              block_size=indexer.block_size, scale=scaling)
    return out.transpose(1, 2)


def _msa_training(module, query, key, value, scaling, proxy: IndexerProxy):
    indexer = module.indexer
    handle: MsaTraining = indexer._flash_msa
    B, H, S, D = query.shape
    if key.shape[2] != S:
        raise ValueError(f"flash_msa training mode: {key.shape[2]} keys for {S} queries; training mode runs whole "
                         f"sequences (an empty cache or use_cache=False); for decoding call handle.disable()")
    sparse = handle.mode == "sparse"
    fn = _msa_function(sparse, handle.packed)
    options = dict(block_size=indexer.block_size, kl_value=handle.kl_value,
                   kl_metric=_kl_metric(handle, indexer.layer_idx, query.device),
                   **_semantics_options(handle, indexer))
    if sparse:
        options["select_precision"] = handle.select_precision
    top_k = indexer.topk_blocks * indexer.block_size
    if handle.packed:
        out, kl_loss = _packed_msa(handle, fn, proxy, query, key, value, top_k, scaling, options)
    else:
        out, kl_loss = fn(proxy.idx_q, proxy.idx_k, query, key, value, top_k, scaling, **options)
    handle.kl_losses[indexer.layer_idx] = kl_loss
    return out.view(B, S, H, D)


def _msa_function(sparse: bool, packed: bool):
    if packed:
        return flash_msa_rt.flash_msa_varlen_func if sparse else flash_msa_rt.flash_msa_warmup_varlen_func
    return flash_msa_rt.flash_msa_func if sparse else flash_msa_rt.flash_msa_warmup_func


def _packed_msa(handle, fn, proxy, query, key, value, top_k, scaling, options):
    """The varlen form over the batch's documents: (B * S, heads, D) tokens, offsets from position_ids, every
    document at most a row long (max_seqlen = S)."""
    B, _, S, _ = query.shape
    if torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
        # Offsets of a fixed B * S + 1 entries plan on the device as B * S sequences of S tokens each
        # (flash_msa_rt.ops.packed._DevicePadded): far too large; only the host read makes them compact.
        raise RuntimeError("flash_msa training mode: packed=True reads the documents' offsets from position_ids on "
                           "the host, which torch.compile and CUDA graph capture cannot; enable_msa_training(..., "
                           "packed=False) runs there (each row one sequence), or call flash_msa_varlen_func with "
                           "offsets of a fixed document count yourself")
    cu_seqlens = handle.offsets(proxy.position_ids)
    tokens = [t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[3])
              for t in (proxy.idx_q, proxy.idx_k, query, key, value)]
    return fn(*tokens, cu_seqlens, S, top_k, scaling, **options)


def _kl_metric(handle: MsaTraining, layer_idx: int, device):
    if handle.kl_value == "none":
        return None
    metric = handle.kl_metric.get(layer_idx)
    if metric is None or metric.device != device:
        metric = handle.kl_metric[layer_idx] = torch.zeros((), dtype=torch.float32, device=device)
    return metric


def _semantics_options(handle: MsaTraining, indexer) -> dict:
    """proxy_scale and local_blocks of flash_msa_func: the handle's, else the indexer's own (M3's unscaled-score
    indexer as a softmax at index_head_dim ** -0.5; its index_local_blocks)."""
    return {"proxy_scale": handle.proxy_scale if handle.proxy_scale is not None else indexer.head_dim ** -0.5,
            "local_blocks": handle.local_blocks if handle.local_blocks is not None else indexer.local_blocks}


# --- registration ----------------------------------------------------------------------------------------------------

def register() -> None:
    """Register attn_implementation="flash_msa" (idempotent). Its masks are SDPA's: dense layers get exactly the
    "sdpa" path's mask (none for an unpadded, unpacked batch: is_causal), sparse layers ignore it."""
    for name in (ATTN_IMPLEMENTATION, ALIAS):
        AttentionInterface.register(name, flash_msa_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


register()
