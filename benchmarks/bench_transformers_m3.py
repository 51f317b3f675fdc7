"""One training step (forward + backward) of MiniMax-M3's attention block in transformers, at M3's full shape.

The block is transformers' own MiniMaxM3VLAttention of a sparse layer (hidden 6144, 64 query heads, 4 KV heads,
D 128, QK-norm, partial RoPE; the indexer's 4 heads over one key head of 128, top-16 blocks of 128, the local
block forced), projections included, B = 1, bf16, random weights. Three ways:
  msa          this integration's training mode (flash_msa_rt.integrations.transformers.enable_msa_training,
               mode="sparse", kl_value="deferred"): selection, sparse attention and the indexer's KL on the kernels;
               loss = <out, g> + kl_loss
  hf_sdpa      transformers' own Hopper path: attn_implementation="sdpa", the indexer's fp32 (B, 4, S, S) scores
               and the (B, 64, S, S) block mask (OOM reported as such)
  msa_unpacked the same with packed=False: each row one sequence, no offsets from position_ids (not in the default
               methods)
  dense_sdpa   the same block as a full-attention layer: dense causal SDPA (cuDNN first), no indexer
Reports ms per step, tokens/s and peak memory per length; JSON to benchmarks/results/transformers_m3.json and a
plot beside it. Targets (issue 54): 128K trains on one H200; msa >= 3x dense_sdpa at 64K and >= 5x at 128K.

    python benchmarks/bench_transformers_m3.py [--seqlens 16384,32768,65536,131072] [--reps 5] [--out NAME]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, cuda_time_ms, write_results  # noqa: E402

METHODS = ("msa", "hf_sdpa", "dense_sdpa")
SEQLENS = (16384, 32768, 65536, 131072)


def m3_block_config(sparse: bool, attn_implementation: str):
    """M3's text config (its defaults are the released shape) with one layer of the given kind."""
    from transformers import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(
        num_hidden_layers=1, layer_types=["minimax_m3_sparse" if sparse else "full_attention"],
        mlp_layer_types=["dense"], bos_token_id=None, eos_token_id=None, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        attn_implementation=attn_implementation)


def build(method: str):
    """(attention block, rotary embedding, its MsaTraining handle or None) on the GPU in bf16."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

    sparse = method != "dense_sdpa"
    config = m3_block_config(sparse, "sdpa")
    torch.manual_seed(0)
    block = m3.MiniMaxM3VLAttention(config, layer_idx=0)
    for p in block.parameters():
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=config.hidden_size ** -0.5)
    block = block.to(device="cuda", dtype=torch.bfloat16)
    handle = None
    if method in ("msa", "msa_unpacked"):
        import flash_msa_rt.integrations.transformers as fmt

        handle = fmt.enable_msa_training(block, mode="sparse", kl_value="deferred", packed=method == "msa")
    rotary = m3.MiniMaxM3VLRotaryEmbedding(config).to("cuda")
    return block, rotary, handle


def step_fn(block, rotary, handle, S: int):
    """A closure running one forward + backward of the block over S tokens."""
    hidden = torch.randn(1, S, block.config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(S, device="cuda").unsqueeze(0)
    position_embeddings = rotary(hidden, position_ids)
    grad = torch.randn(1, S, block.config.hidden_size, device="cuda", dtype=torch.bfloat16)

    def step():
        out, _ = block(hidden, position_embeddings, None, position_ids=position_ids)
        loss = (out.float() * grad).sum()
        if handle is not None:
            loss = loss + handle.kl_loss()
        loss.backward()
        hidden.grad = None
        block.zero_grad(set_to_none=True)

    return step


def measure(method: str, S: int, reps: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        block, rotary, handle = build(method)
        step = step_fn(block, rotary, handle, S)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.MATH], set_priority=True):
            ms = cuda_time_ms(step, warmup=1, reps=reps)
    except torch.OutOfMemoryError:
        return {"method": method, "seqlen": S, "oom": True}
    finally:
        torch.cuda.synchronize()
    return {"method": method, "seqlen": S, "oom": False, "ms": ms, "tokens_per_s": S / ms * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}


def speedups(rows: list) -> dict:
    """msa's speed over dense_sdpa per length (the issue's targets: >= 3x at 64K, >= 5x at 128K)."""
    by = {(r["method"], r["seqlen"]): r for r in rows}
    out = {}
    for (method, S), r in by.items():
        dense = by.get(("dense_sdpa", S))
        if method == "msa" and not r["oom"] and dense and not dense["oom"]:
            out[str(S)] = dense["ms"] / r["ms"]
    return out


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for method in METHODS:
        ok = [r for r in rows if r["method"] == method and not r["oom"]]
        if ok:
            ax_speed.plot([r["seqlen"] for r in ok], [r["tokens_per_s"] for r in ok], "o-", label=method)
            ax_mem.plot([r["seqlen"] for r in ok], [r["peak_gib"] for r in ok], "o-", label=method)
        for r in rows:
            if r["method"] == method and r["oom"]:
                ax_mem.annotate(f"{method} OOM", (r["seqlen"], 0), rotation=90, fontsize=7)
    for ax, label in ((ax_speed, "tokens / s (fwd + bwd)"), (ax_mem, "peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (B = 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax_speed.set_yscale("log")
    fig.suptitle("MiniMax-M3 attention block, one training step (H = 64, Hk = 4, D = 128, top-16 x 128)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="transformers_m3")
    args = parser.parse_args(argv)
    rows = []
    for S in map(int, args.seqlens.split(",")):
        for method in args.methods.split(","):
            row = measure(method, S, args.reps)
            rows.append(row)
            shown = "OOM" if row["oom"] else (f"{row['ms']:9.1f} ms  {row['tokens_per_s']:10.0f} tok/s  "
                                              f"{row['peak_gib']:6.1f} GiB")
            print(f"S={S:7d}  {method:10s}  {shown}", flush=True)
    result = {"rows": rows, "speedup_msa_over_dense": speedups(rows),
              "shape": {"hidden": 6144, "H": 64, "Hk": 4, "D": 128, "Hp": 4, "Dp": 128, "block": 128, "top_blocks": 16},
              "step": "forward + backward of MiniMaxM3VLAttention (projections, norms, RoPE, indexer included), B=1, "
                      "bf16; msa adds the indexer's kl_loss (deferred)"}
    print("msa speed-up over dense SDPA:", {k: f"{v:.2f}x" for k, v in result["speedup_msa_over_dense"].items()})
    path = write_results(args.out, result)
    try:
        plot(rows, RESULTS / f"{args.out}.png")
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
