"""Tuning choices at small sizes, on device time: one public flash_msa_func forward + backward (kl_value deferred,
top_k 2048, B = 1) captured in a CUDA graph per setting (the choice is read at capture, as reduce-overhead's graph
keeps it), the graphs replayed interleaved round by round with one of cuDNN's dense causal fwd + bwd on the same
q, k, v (torch SDPA); per setting the median replay ms over the rounds and its ratio to dense.

    python benchmarks/sweep_small.py a:8192 a:16384 b:65536:1:256 \
        --settings '[{"sparse_bwd": {"tiles_per_item": 16}}, ...]' [--rounds 5] [--reps 20] [--out FILE]

A spec is cfg:S[:B[:D[:Bs]]]: configuration, sequence length, batch (1), main head dim (128; the proxy's is 64 at
D 64, 128 otherwise), key block size (128).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.common import captured, commit  # noqa: E402


def parse_spec(spec: str) -> tuple[str, int, int, int, int]:
    """cfg:S[:B[:D[:Bs]]] -> (cfg, S, B, D, Bs)."""
    cfg, *rest = spec.split(":")
    S, B, D, Bs = [int(v) for v in rest] + [1, 128, 128][len(rest) - 1:]
    return cfg, S, B, D, Bs


def problem(cfg: str, S: int, B: int, D: int) -> dict:
    """random_problem(cfg) at batch B and main head dim D; proxy heads of Dp = 64 at D = 64 and 128 otherwise (the
    matrix benchmark's)."""
    return random_problem(cfg, S, B * S, head_dim=D, proxy_head_dim=64 if D == 64 else 128)


def graphed_step(spec: str, overrides: dict):
    """A CUDA graph of one deferred-KL fwd + bwd under the overrides (warmed on a side stream first)."""
    from flash_msa_rt import flash_msa_func, tuning

    cfg, S, B, D, Bs = parse_spec(spec)
    x = problem(cfg, S, B, D)
    leaves = tuple(x[n].detach().requires_grad_() for n in ("qp", "kp", "q", "k", "v"))
    dout = torch.randn(B, S, x["H"] * D, device="cuda", dtype=torch.bfloat16)
    coef = torch.tensor(0.1, device="cuda")
    metric = torch.zeros((), device="cuda")

    def step():
        out, kl = flash_msa_func(*leaves, top_k=2048, block_size=Bs, layout="bshd", kl_value="deferred",
                                 kl_metric=metric)
        return torch.autograd.grad((out, kl), leaves, (dout, coef))

    with tuning.override(**overrides):
        graph, grads = captured(step)
    return graph, (x, leaves, grads)


def graphed_dense(spec: str):
    """A CUDA graph of cuDNN's dense causal attention fwd + bwd (torch SDPA, kv heads repeated) on the same q, k, v:
    the baseline each setting is compared with."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg, S, B, D, _ = parse_spec(spec)
    x = problem(cfg, S, B, D)
    q, k, v = (x[n].transpose(1, 2).detach().requires_grad_() for n in ("q", "k", "v"))
    rep = q.shape[1] // k.shape[1]
    dout = torch.randn_like(q)

    def step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    graph, grads = captured(step)
    return graph, (q, k, v, grads)


def replay_ms(graph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+", help="cfg:S[:B[:D[:Bs]]]")
    ap.add_argument("--settings", type=json.loads, required=True, help="JSON list of tuning overrides")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    settings = [{}] + list(a.settings)
    result = dict(benchmark="sweep_small", commit=commit(), device=torch.cuda.get_device_name(), settings=settings,
                  method="CUDA graph of one deferred-KL fwd + bwd per setting and of cuDNN dense causal fwd + bwd "
                         "(torch SDPA), replays timed with events, interleaved round by round; median over rounds "
                         "of the mean replay ms", problems={})
    for spec in a.specs:
        graphs = [graphed_dense(spec)] + [graphed_step(spec, s) for s in settings]
        times = [[] for _ in graphs]
        for _ in range(a.rounds):
            for n, (graph, _) in enumerate(graphs):
                times[n].append(replay_ms(graph, a.reps))
        dense, *medians = [statistics.median(t) for t in times]
        result["problems"][spec] = dict(
            dense_ms=dense, dense_rounds=times[0],
            settings=[{"setting": s, "ms": m, "x_dense": dense / m, "rounds": t}
                      for s, m, t in zip(settings, medians, times[1:])])
        print(f"{spec}: cuDNN dense {dense:.3f} ms; defaults {medians[0]:.3f} ms ({dense / medians[0]:.2f}x dense)",
              flush=True)
        for s, m in zip(settings[1:], medians[1:]):
            print(f"  {m:.3f} ms ({m / medians[0]:.3f}x defaults, {dense / m:.2f}x dense)  {json.dumps(s)}", flush=True)
        del graphs
        torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
