"""Proxy recall: how much of the main heads' attention the proxy's block selection keeps.

For a sample of query positions i, the main attention probabilities P_h(i, t) over the full causal prefix are
computed densely with plain torch from the layer's own q and k; the selection Sel_p(i) comes from
flash_msa_rt.select_blocks. recall = mean over (h, i) of sum over t in selected blocks of P_h(i, t): 1 means the
sparse attention sees all the mass dense attention would. coverage = the share of the causal keys the selection
keeps, i.e. the recall a uniform attention pattern would get; recall well above coverage means the proxy has
learned where the mass is.

Queries are drawn only where the selection can drop something (blk(i) >= K, more visible blocks than slots):
elsewhere recall is 1 by construction.

Both selection precisions are measured on the same proxy and queries: recall_bf16, recall_fp8 (select_precision
"fp8": e4m3 proxy scores) and agreement, the share of (proxy head, query) rows whose two selected sets are equal;
"recall" and "coverage" are the run's own precision's.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def proxy_recall(q_proxy: torch.Tensor, k_proxy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, top_k: int,
                 block_size: int, num_queries: int, generator: torch.Generator, select_precision: str = "bf16") -> dict:
    """Tensors (1, S, heads, dim) as captured by the model (BSHD). Returns {"recall", "coverage", "recall_bf16",
    "recall_fp8", "agreement", "queries"}."""
    import flash_msa_rt

    _, S, H, D = q.shape
    Hk, Hp = k.shape[2], q_proxy.shape[2]
    K = top_k // block_size
    lo = K * block_size  # first query whose causal prefix has more than K blocks
    if lo >= S:
        return {"recall": 1.0, "coverage": 1.0, "recall_bf16": 1.0, "recall_fp8": 1.0, "agreement": 1.0,
                "queries": 0}
    idx = lo + torch.randperm(S - lo, generator=generator)[:num_queries]
    idx = idx.sort().values.to(q.device)
    n = idx.numel()
    t = torch.arange(S, device=q.device)
    causal = t[None, :] <= idx[:, None]  # (n, S)

    # Main attention over the full causal prefix, fp32: (H, n, S).
    qs = q[0, idx].float().transpose(0, 1)  # (H, n, D)
    ks = k[0].float().transpose(0, 1).repeat_interleave(H // Hk, dim=0)  # (H, S, D)
    scores = (qs @ ks.transpose(1, 2)) * D ** -0.5
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)

    out, sets = {}, {}
    for precision in ("bf16", "fp8"):
        sel = flash_msa_rt.select_blocks(q_proxy.transpose(1, 2), k_proxy.transpose(1, 2), top_k,
                                         block_size=block_size, select_precision=precision)  # (1, Hp, S, K)
        sel = sel[0][:, idx].long()  # (Hp, n, K), -1 = empty
        sets[precision] = sel.sort(-1).values
        NB = -(-S // block_size)
        chosen = torch.zeros(Hp, n, NB + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(2, torch.where(sel < 0, NB, sel), True)  # empty slots land in the spare column NB
        kept = chosen[:, :, t // block_size] & causal  # (Hp, n, S)
        kept_h = kept.repeat_interleave(H // Hp, dim=0)  # main head h belongs to proxy group h // (H / Hp)
        out[f"recall_{precision}"] = float((probs * kept_h).sum(-1).mean())
        if precision == select_precision:
            out["recall"] = out[f"recall_{precision}"]
            out["coverage"] = float((kept.sum(-1).float() / causal.sum(-1).float()).mean())
    out["agreement"] = float((sets["bf16"] == sets["fp8"]).all(-1).float().mean())
    return {**out, "queries": int(n)}
