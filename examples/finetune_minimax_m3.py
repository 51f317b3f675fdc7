"""Train a small MiniMax-M3-shaped model of transformers with MSA: warmup steps, then sparse steps.

A randomly initialised MiniMaxM3VLForCausalLM (its layer pattern: sparse layers with an indexer and a
full-attention layer) learns the repository's corpus (examples/corpus.py: the Python standard library as bytes).
flash_msa_rt.integrations.transformers.enable_msa_training switches its sparse layers to flash_msa_warmup_func
(dense main attention, the indexer trained by the KL) for --warmup-steps, then to flash_msa_func (main attention
over the indexer's top blocks). Loss = LM loss + kl_coef * KL. Logs the LM loss, the KL and the indexer's recall
of the main attention's mass (examples/msa_metrics.py) into --out/metrics.json and plots them (metrics.png).

    python examples/finetune_minimax_m3.py                    # CPU: 512 tokens, a few minutes on 2 cores
    python examples/finetune_minimax_m3.py --preset tiny      # the CI smoke test's seconds
    python examples/finetune_minimax_m3.py --preset gpu       # 16K tokens, bf16, blocks of 128, top-16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):  # sibling modules, and the source tree's flash_msa_rt when not installed
    if p not in sys.path:
        sys.path.insert(0 if p == str(HERE) else len(sys.path), p)

import torch  # noqa: E402

from corpus import load_corpus  # noqa: E402
from msa_metrics import proxy_recall  # noqa: E402


@dataclass
class Config:
    seq_len: int = 512
    batch_size: int = 2
    docs_per_row: int = 2  # documents packed per row (position_ids restart): each selects within itself
    steps: int = 60
    warmup_steps: int = 20
    lr: float = 2e-3
    kl_coef: float = 1.0
    recall_every: int = 10
    seed: int = 0
    max_corpus_bytes: int | None = 4_000_000
    # model: M3's layout, scaled down
    hidden: int = 128
    layers: int = 2  # the last one full attention, the others sparse
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    index_heads: int = 2
    index_head_dim: int = 64
    block_size: int = 64
    topk_blocks: int = 2
    dtype: str = "float32"
    device: str = "cpu"


PRESETS = {
    "cpu": Config(),
    "tiny": Config(seq_len=256, batch_size=1, steps=4, warmup_steps=2, recall_every=2, max_corpus_bytes=200_000),
    "gpu": Config(seq_len=16384, batch_size=1, docs_per_row=1, steps=300, warmup_steps=100, lr=1e-3,
                  recall_every=25, max_corpus_bytes=None, hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=128,
                  index_heads=4, index_head_dim=128, block_size=128, topk_blocks=16, dtype="bfloat16",
                  device="cuda"),
}


def build_model(cfg: Config):
    from transformers import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    config = MiniMaxM3VLTextConfig(
        vocab_size=256, hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim, index_block_size=cfg.block_size,
        index_topk_blocks=cfg.topk_blocks, index_local_blocks=1,
        layer_types=["minimax_m3_sparse"] * (cfg.layers - 1) + ["full_attention"],
        mlp_layer_types=["dense"] * cfg.layers, dense_intermediate_size=2 * cfg.hidden, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, use_cache=False, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    return MiniMaxM3VLForCausalLM(config).to(device=cfg.device, dtype=getattr(torch, cfg.dtype))


def batch(data: torch.Tensor, cfg: Config, step: int):
    """input_ids and position_ids for a step: random windows of the corpus, each row cut into docs_per_row
    documents whose positions restart (transformers' packed convention); seeded by (seed, step)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - cfg.seq_len, (cfg.batch_size,), generator=g)
    ids = torch.stack([data[s:s + cfg.seq_len].long() for s in starts.tolist()])
    cuts = sorted(torch.randint(cfg.seq_len // 4, 3 * cfg.seq_len // 4, (cfg.docs_per_row - 1,), generator=g).tolist())
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, cfg.seq_len])]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).expand(cfg.batch_size, -1)
    return ids.to(cfg.device), position_ids.to(cfg.device)


@torch.no_grad()
def indexer_recall(model, ids, cfg: Config) -> float:
    """The first sparse layer's indexer recall of its main attention (msa_metrics.proxy_recall) on one sequence:
    q, k and idx_q, idx_k formed from the layer's input exactly as the model forms them."""
    import flash_msa_rt.integrations.transformers as fmt
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb

    attn, seen = model.model.layers[0].self_attn, {}
    hook = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    model(ids[:1])
    hook.remove()
    h, pos = seen["hidden_states"], seen["position_embeddings"]
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(h).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(h).view(shape)).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *pos)
    idx_q, idx_k = fmt.indexer_proxy(attn.indexer, h, pos)
    bshd = [t.transpose(1, 2) for t in (idx_q, idx_k, q, k)]
    result = proxy_recall(*bshd, top_k=cfg.topk_blocks * cfg.block_size, block_size=cfg.block_size,
                          num_queries=64, generator=torch.Generator().manual_seed(0))
    return result["recall"], result["coverage"]


def train(cfg: Config, out: Path, progress: bool = True) -> dict:
    import flash_msa_rt.integrations.transformers as fmt

    corpus = load_corpus(max_bytes=cfg.max_corpus_bytes)
    model = build_model(cfg)
    msa = fmt.enable_msa_training(model, mode="warmup", kl_value="deferred")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    history = []
    for step in range(cfg.steps):
        mode = "warmup" if step < cfg.warmup_steps else "sparse"
        msa.set_mode(mode)
        ids, position_ids = batch(corpus.train, cfg, step)
        t0 = time.perf_counter()
        lm_loss = model(ids, labels=ids, position_ids=position_ids).loss
        (lm_loss + cfg.kl_coef * msa.kl_loss()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        row = {"step": step, "mode": mode, "lm_loss": lm_loss.item(),
               "kl": sum(m.item() for m in msa.kl_metrics().values()), "seconds": time.perf_counter() - t0}
        if step % cfg.recall_every == 0 or step == cfg.steps - 1:
            row["recall"], row["coverage"] = indexer_recall(model, ids, cfg)
        history.append(row)
        if progress:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    metrics = {"config": asdict(cfg), "history": history}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def plot(metrics: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = metrics["history"]
    warmup_end = metrics["config"]["warmup_steps"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    recall = [r for r in h if "recall" in r]
    series = (("LM loss", [r["step"] for r in h], [r["lm_loss"] for r in h]),
              ("indexer KL (sum over sparse layers)", [r["step"] for r in h], [r["kl"] for r in h]),
              ("indexer recall (layer 0)", [r["step"] for r in recall], [r["recall"] for r in recall]))
    for ax, (title, x, y) in zip(axes, series):
        ax.plot(x, y, "o-" if len(x) < 30 else "-")
        ax.axvline(warmup_end - 0.5, color="gray", ls="--", lw=1, label="warmup | sparse")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[2].plot([r["step"] for r in recall], [r["coverage"] for r in recall], "x:", label="coverage (uniform)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--out", default=str(HERE / "runs" / "minimax_m3"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("steps", args.steps), ("warmup_steps", args.warmup_steps),
                                   ("seq_len", args.seq_len)) if v is not None}
    cfg = replace(PRESETS[args.preset], **overrides)
    out = Path(args.out)
    metrics = train(cfg, out, progress=not args.no_progress)
    if not args.no_plot:
        plot(metrics, out / "metrics.png")
    return metrics


if __name__ == "__main__":
    main()
