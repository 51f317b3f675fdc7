"""Small random-weight MiniMax-M3 models of transformers (no download) for the integration's tests, example and
benchmark: the M3 layer pattern (a sparse layer with its indexer, a full-attention layer; a dense MLP and a MoE) at
a size a CPU runs in a second."""

from __future__ import annotations

import torch


def m3_config(*, hidden=64, heads=4, kv_heads=2, head_dim=64, index_heads=2, index_head_dim=64, block_size=64,
              topk_blocks=2, local_blocks=1, layer_types=("minimax_m3_sparse", "full_attention"),
              mlp_layer_types=("dense", "sparse"), vocab=256, attn_implementation="sdpa"):
    from transformers import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, index_n_heads=index_heads,
        index_head_dim=index_head_dim, index_block_size=block_size, index_topk_blocks=topk_blocks,
        index_local_blocks=local_blocks, layer_types=list(layer_types), mlp_layer_types=list(mlp_layer_types),
        dense_intermediate_size=hidden, shared_intermediate_size=hidden // 2, num_local_experts=4,
        num_experts_per_tok=2, bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=False,
        # M3 rotates half of each head (the checkpoint's partial RoPE); the indexer the first of its channels too
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        attn_implementation=attn_implementation)


def m3_model(config=None, seed=0, dtype=torch.float32, device="cpu"):
    """MiniMaxM3VLForCausalLM with random weights; the RMSNorm gains (zeros at init: Gemma's 1 + w) randomised too
    so their gradients and the norms' effect on the indexer are exercised."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(config if config is not None else m3_config())
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.1)
    return model.to(device=device, dtype=dtype)
