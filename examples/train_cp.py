"""The MSA run of examples/train_msa.py with each sequence sharded over the ranks of a torch.distributed group
(context parallelism, flash_msa_rt.distributed): launched by torchrun with `--cp N`.

Every rank builds the same model from the same seed and reads the same batches; it keeps its zigzag shard of each
sequence (tokens and targets, with their global positions for RoPE), attends through flash_msa_cp_func /
flash_msa_warmup_cp_func, and takes its share of the LM loss (its tokens' cross-entropy summed over all B S tokens).
kl_loss is the whole sequence's value on every rank, its gradient this rank's rows only. So the sum over ranks of
the gradients is the single-process gradient: the ranks all-reduce (sum) their parameter gradients, clip and step
alike, and stay identical to one process training on whole sequences, up to floating-point summation order.
Evaluation, recall and checkpoints are the single-process run's business and are not done here.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _cp_attend(mode: str, cfg, kl_value: str, group, kl_metrics: list):
    from flash_msa_rt.distributed import flash_msa_cp_func, flash_msa_warmup_cp_func

    fn = flash_msa_warmup_cp_func if mode == "warmup" else flash_msa_cp_func

    def attend(q_proxy, k_proxy, q, k, v, sinks=None):  # (B, S_local, heads, dim)
        metric = torch.zeros((), dtype=torch.float32, device=q.device)
        kl_metrics.append(metric)
        with torch.autocast(q.device.type, enabled=False):
            return fn(q_proxy, k_proxy, q, k, v, cfg.top_k, group=group, layout="bshd", block_size=cfg.block_size,
                      kl_value=kl_value, kl_metric=metric, seqlen=cfg.seq_len, sinks=sinks,
                      local_blocks=cfg.local_blocks)
    return attend


def train_cp(trainer, group=None) -> dict:
    """The MSA run's history (step, mode, lm_loss, kl, loss, tokens_per_s, lr) on every rank."""
    from flash_msa_rt.distributed import shard_sequence, shard_spans
    from train_msa import lr_at, step_generator

    cfg, device = trainer.cfg, trainer.device
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    spans = shard_spans(cfg.seq_len, world, rank)
    positions = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
    model, opt = trainer.new_model()
    h = {k: [] for k in ("step", "mode", "lm_loss", "kl", "loss", "tokens_per_s", "lr")}
    for step in range(cfg.steps):
        mode = trainer.mode("msa", step)
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = trainer.corpus.batch("train", cfg.batch_size, cfg.seq_len, step_generator(cfg, 0, step), device)
        x, y = (shard_sequence(t, group, seq_dim=1) for t in (x, y))
        kl_metrics: list = []
        t0 = time.perf_counter()
        with trainer.autocast:
            logits, kl = model(x, _cp_attend(mode, cfg, trainer.kl_value, group, kl_metrics), positions)
        lm_share = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / (
            cfg.batch_size * cfg.seq_len)
        loss = lm_share + cfg.kl_coef * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():  # the sum over ranks is the single-process gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        lm = lm_share.detach().clone()
        dist.all_reduce(lm, group=group)
        kl_v = torch.stack(kl_metrics).mean().item() if kl_metrics else kl.item()
        lm_v = lm.item()
        h["step"].append(step)
        h["mode"].append(mode)
        h["lm_loss"].append(lm_v)
        h["kl"].append(kl_v)
        h["loss"].append(lm_v + cfg.kl_coef * kl_v)
        h["tokens_per_s"].append(cfg.batch_size * cfg.seq_len / (time.perf_counter() - t0))
        h["lr"].append(lr)
        if rank == 0:
            print(f"step {step} ({mode}): lm loss {lm_v:.4f}, proxy KL {kl_v:.4f}", flush=True)
    return h
