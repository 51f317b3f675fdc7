"""A small decoder-only byte transformer whose attention is pluggable: MSA (flash_msa_rt) or dense SDPA.

Every attention layer owns the main projections (H query heads, Hk KV heads, GQA) and the MSA proxy projections
(Hp proxy query heads, Hpk proxy key heads). Both runs of the example build the model from the same seed, so the
dense baseline starts from exactly the MSA run's weights; its proxy projections simply receive no gradient.

Positions: rotary embeddings (RoPE) on q, k and on the proxy's q, k, so the proxy can learn locality the same way
the main heads do.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# attend(q_proxy, k_proxy, q, k, v) -> (out (B, S, H * D), kl_loss 0-dim fp32). Inputs are (B, S, heads, dim).
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                    tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    d_model: int = 256
    n_layers: int = 2
    heads: int = 4  # H
    kv_heads: int = 2  # Hk
    head_dim: int = 64  # D
    proxy_heads: int = 2  # Hp
    proxy_kv_heads: int = 1  # Hpk
    proxy_dim: int = 64  # Dp
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    sinks: bool = False  # a learned sink logit per main head (gpt-oss style), for the MSA attention

    def __post_init__(self):
        for name in ("d_model", "n_layers", "heads", "kv_heads", "head_dim", "proxy_heads", "proxy_kv_heads",
                     "proxy_dim", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads = {self.heads} must be a multiple of kv_heads = {self.kv_heads}")
        if self.heads % self.proxy_heads:
            raise ValueError(f"heads = {self.heads} must be a multiple of proxy_heads = {self.proxy_heads}")
        if self.proxy_heads % self.proxy_kv_heads:
            raise ValueError(f"proxy_heads = {self.proxy_heads} must be a multiple of proxy_kv_heads = "
                             f"{self.proxy_kv_heads}")
        if self.head_dim % 2 or self.proxy_dim % 2:
            raise ValueError(f"head_dim = {self.head_dim} and proxy_dim = {self.proxy_dim} must be even (RoPE)")

    def to_dict(self) -> dict:
        return asdict(self)


class Rotary(nn.Module):
    """RoPE tables for one head dim, grown on demand; applied in fp32, returned in the input dtype."""

    def __init__(self, dim: int, base: float):
        super().__init__()
        self.register_buffer("inv_freq", base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim),
                             persistent=False)
        self._cache: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None

    def _tables(self, seq_len: int, device: torch.device):
        if self._cache is None or self._cache[0] < seq_len or self._cache[1] != device:
            t = torch.arange(seq_len, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))  # (S, dim / 2)
            self._cache = (seq_len, device, freqs.cos(), freqs.sin())
        return self._cache[2][:seq_len], self._cache[3][:seq_len]

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, S, heads, dim); positions (S,) int64: each token's position in its sequence (default 0..S-1; a
        context-parallel rank holds tokens from several places of the sequence)."""
        if positions is None:
            cos, sin = self._tables(x.shape[1], x.device)
        else:
            cos, sin = self._tables(int(positions.max()) + 1 if positions.numel() else 0, x.device)
            cos, sin = cos[positions], sin[positions]
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg
        self.wq = nn.Linear(c.d_model, c.heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * c.head_dim, c.d_model, bias=False)
        self.wq_proxy = nn.Linear(c.d_model, c.proxy_heads * c.proxy_dim, bias=False)
        self.wk_proxy = nn.Linear(c.d_model, c.proxy_kv_heads * c.proxy_dim, bias=False)
        self.rope = Rotary(c.head_dim, c.rope_base)
        self.rope_proxy = self.rope if c.proxy_dim == c.head_dim else Rotary(c.proxy_dim, c.rope_base)
        # One float32 sink logit per head, learned (flash_msa_func's sinks; starts at 0: exp(0) = one key's worth).
        self.sinks = nn.Parameter(torch.zeros(c.heads)) if c.sinks else None
        # Set by the trainer to a list to receive (q_proxy, k_proxy, q, k) of batch row 0 for the recall metric.
        self.capture: list | None = None

    def forward(self, x: torch.Tensor, attend: AttendFn, positions: torch.Tensor | None = None):
        c = self.cfg
        B, S, _ = x.shape
        q = self.rope(self.wq(x).view(B, S, c.heads, c.head_dim), positions)
        k = self.rope(self.wk(x).view(B, S, c.kv_heads, c.head_dim), positions)
        v = self.wv(x).view(B, S, c.kv_heads, c.head_dim)
        # The proxy reads a detached residual stream: the KL loss then trains the proxy projections and nothing
        # else (flash_msa_func already keeps the KL gradient away from q, k, v; this keeps it out of x too).
        xp = x.detach()
        q_proxy = self.rope_proxy(self.wq_proxy(xp).view(B, S, c.proxy_heads, c.proxy_dim), positions)
        k_proxy = self.rope_proxy(self.wk_proxy(xp).view(B, S, c.proxy_kv_heads, c.proxy_dim), positions)
        if self.capture is not None:
            self.capture.append(tuple(t[:1].detach() for t in (q_proxy, k_proxy, q, k)))
        out, kl = attend(q_proxy, k_proxy, q, k, v, **({} if self.sinks is None else {"sinks": self.sinks}))
        return self.wo(out), kl


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False))

    def forward(self, x: torch.Tensor, attend: AttendFn, positions: torch.Tensor | None = None):
        a, kl = self.attn(self.norm1(x), attend, positions)
        x = x + a
        return x + self.mlp(self.norm2(x)), kl


class ByteLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self._init_weights()

    def _init_weights(self):
        # GPT-2 style: N(0, 0.02), the projections that write into the residual stream scaled by 1/sqrt(2 L).
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor, attend: AttendFn,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B, S, vocab) and the mean over layers of the proxy KL loss; positions as Rotary's."""
        x = self.embed(tokens)
        kls = []
        for block in self.blocks:
            x, kl = block(x, attend, positions)
            kls.append(kl)
        return self.head(self.norm(x)), torch.stack(kls).mean()

    def set_capture(self, on: bool) -> list[list]:
        """Turn capture of (q_proxy, k_proxy, q, k) on or off in every layer; returns the per-layer lists."""
        sinks = []
        for block in self.blocks:
            block.attn.capture = [] if on else None
            sinks.append(block.attn.capture)
        return sinks

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices only (not on norms or embeddings)."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (decay if p.dim() == 2 and not name.startswith("embed") else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# --- attention backends -------------------------------------------------------------------------------------

def dense_attend(q_proxy, k_proxy, q, k, v, sinks=None):
    """The baseline: dense causal attention through torch SDPA; no proxy, so the KL is zero. sinks is taken and
    not used: the baseline is the plain-softmax model, whose sink parameters (--sinks) receive no gradient, as its
    proxy projections.

    KV heads are repeated explicitly rather than with enable_gqa so that every SDPA backend (flash on the GPU)
    accepts the call.
    """
    B, S, H, D = q.shape
    rep = H // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, S, D)
    if rep > 1:
        kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    return out.transpose(1, 2).reshape(B, S, H * D), q.new_zeros((), dtype=torch.float32)


def msa_attend(mode: str, top_k: int, block_size: int, kl_value: str = "exact",
               kl_metrics: list | None = None, select_precision: str = "bf16", local_blocks: int = 1) -> AttendFn:
    """MSA through the public flash_msa_rt API: mode "warmup" (dense main attention, proxy trained by KL over
    the causal prefix) or "sparse" (main attention over the proxy's top-k blocks). kl_value as the API's; with
    kl_metrics (a list) each call appends the 0-dim tensor its KL value lands in ("deferred": after the backward).
    select_precision: the sparse mode's (warmup selects nothing); local_blocks: the recent blocks every query
    always selects. attend's sinks (a layer's sink parameter) reach the API as they are."""
    import flash_msa_rt

    if mode not in ("warmup", "sparse"):
        raise ValueError(f"msa_attend: mode must be 'warmup' or 'sparse', got {mode!r}")
    fn = flash_msa_rt.flash_msa_warmup_func if mode == "warmup" else flash_msa_rt.flash_msa_func
    selection = {"select_precision": select_precision} if mode == "sparse" else {}

    def attend(q_proxy, k_proxy, q, k, v, sinks=None):
        # The API's default layout is (B, heads, S, D); the transposes are free views.
        qp, kp, qt, kt, vt = (t.transpose(1, 2) for t in (q_proxy, k_proxy, q, k, v))
        metric = None
        if kl_metrics is not None:
            metric = torch.zeros((), dtype=torch.float32, device=q.device)
            kl_metrics.append(metric)
        return fn(qp, kp, qt, kt, vt, top_k, block_size=block_size, kl_value=kl_value, kl_metric=metric,
                  sinks=sinks, local_blocks=local_blocks, **selection)

    return attend
