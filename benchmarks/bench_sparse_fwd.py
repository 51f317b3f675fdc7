"""The MSA sparse forward, stage by stage: plan, sparse_fwd kernel, combine, sparse_kl kernel, KL combine.

Per configuration of issue 4 ((a) H=16 Hk=2 Hp=4, (b) H=32 Hk=8 Hp=8, (c) H=64 Hk=4 Hp=4; Hpk=1, D=Dp=128, bf16,
top_k 2048 = K 16 blocks, B*S = 128K tokens), on the selection kernel's own block_indices from random inputs.
FLOP formulas (msa-semantics.md): main forward 4*D*nnz, nnz = sum over (b, h, i) of the causal keys of the
selected blocks; the KL pass is reported against the same 4*D*nnz so that its share of the forward reads directly;
backward 10*D*nnz + 6*Dp*nnz_p (main plus proxy KL backward).
Usage: python benchmarks/bench_sparse_fwd.py [--seqlens 8192,32768] [--configs a,b,c] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import PEAK_TFLOPS, commit, cuda_time_ms, write_results  # noqa: E402

CONFIGS = {"a": (16, 2, 4, 1), "b": (32, 8, 8, 1), "c": (64, 4, 4, 1)}


def random_problem(cfg: str, S: int, tokens: int = 131072, device="cuda", seed: int = 0, head_dim: int = 128,
                   proxy_head_dim: int = 128) -> dict:
    """The benchmarks' inputs for configuration cfg at length S: B = tokens // S (at least 1), D = head_dim, Dp =
    proxy_head_dim, bf16 standard normal q_proxy, k_proxy, q, k, v drawn in that order after
    torch.manual_seed(seed)."""
    H, Hk, Hp, Hpk = CONFIGS[cfg]
    B, D = max(1, tokens // S), head_dim
    torch.manual_seed(seed)
    qp, kp = (torch.randn(B, S, h, proxy_head_dim, device=device, dtype=torch.bfloat16) for h in (Hp, Hpk))
    q = torch.randn(B, S, H, D, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hk, D, device=device, dtype=torch.bfloat16) for _ in range(2))
    return dict(B=B, S=S, H=H, Hk=Hk, Hp=Hp, Hpk=Hpk, D=D, G=H // Hp, scale=D ** -0.5, qp=qp, kp=kp, q=q, k=k, v=v)


def spec_problem(spec: str) -> dict:
    """random_problem of "cfg:S" (B * S = 128K tokens) or "cfg:S:B", plus the selection kernel's block_indices
    (top_k 2048: K 16) as "sel", an upstream gradient "go" and a KL gradient "kl_grad" (the mean's, 1 / (B Hp S))."""
    from flash_msa_rt.ops.select import select_blocks_cuda

    cfg, S, *batch = spec.split(":")
    x = random_problem(cfg, int(S), int(S) * int(batch[0]) if batch else 131072)
    x["cfg"] = cfg
    x["sel"] = select_blocks_cuda(x["qp"], x["kp"], 16, 128, x["scale"])
    x["go"] = torch.randn_like(x["q"])
    x["kl_grad"] = torch.full((), 1.0 / (x["B"] * x["Hp"] * x["S"]), device="cuda")
    return x


def api_step(cfg: str, S: int):
    """random_problem of one sequence (B = 1) as autograd leaves and one public-API forward + backward over them
    (flash_msa_func, top_k 2048, then autograd.grad with an upstream gradient and a KL coefficient): (x, leaves
    (qp, kp, q, k, v), dout (1, S, H D), step)."""
    from flash_msa_rt import flash_msa_func

    x = random_problem(cfg, S, S)
    leaves = tuple(x[n].detach().requires_grad_() for n in ("qp", "kp", "q", "k", "v"))
    dout = torch.randn(1, S, x["H"] * x["D"], device="cuda", dtype=torch.bfloat16)
    coef = torch.tensor(0.1, device="cuda")

    def step():
        out, kl = flash_msa_func(*leaves, top_k=2048, layout="bshd")
        return torch.autograd.grad((out, kl), leaves, (dout, coef))

    return x, leaves, dout, step


def nnz_of(sel: torch.Tensor, S: int, G: int, Bs: int = 128) -> int:
    """sum over (b, h, i) of |A_h(i)|: causal keys of each live selected block, times G heads."""
    i = torch.arange(S, device=sel.device).view(1, 1, S, 1)
    start = sel.long() * Bs
    keys = (torch.minimum(i + 1, start + Bs) - start).clamp(min=0)
    return int(torch.where(sel >= 0, keys, torch.zeros_like(keys)).sum().item()) * G


def run(cfg: str, S: int, tokens: int, mma: str = "auto"):
    from flash_msa_rt.loader import get_kernel
    from flash_msa_rt import tuning
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops.device import arch_of
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
    from flash_msa_rt.ops.partials import combine_kl_lse
    from flash_msa_rt.ops.sparse_plan import sparse_plan

    x = random_problem(cfg, S, tokens)
    B, H, Hk, Hp, Hpk, D, G, scale = (x[n] for n in ("B", "H", "Hk", "Hp", "Hpk", "D", "G", "scale"))
    qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
    K = 16
    sel = select_blocks_cuda(qp, kp, K, 128, scale)
    nnz = nnz_of(sel, S, G)
    flops = 4 * D * nnz
    over = {} if mma == "auto" else {"sparse_fwd": {"mma": mma, "kl_mma": mma}}
    with tuning.override(**over):
        t = sf.choice(arch_of(q.device), G, D, 128, B, S, H)
    plan = sparse_plan(sel, 128, S, G, sf.TILE_M // G, t.tiles_per_item)
    E = plan.entry_query.shape[0]
    o_part = torch.empty((E, G, D), dtype=q.dtype, device="cuda")
    lse_part = torch.empty((E, G), dtype=torch.float32, device="cuda")
    kl_plan = sparse_plan(sel, 128, S, G, sf.KL_TILE, t.kl_tiles_per_item)
    kl_cfg = sf.kl_config("bf16", D, 128, G, t)
    kl_part = torch.empty((E, 3 * sf.kl_part_groups(kl_cfg)), dtype=torch.float32, device="cuda")
    fwd = get_kernel("sparse_fwd", sf.kernel_config("bf16", D, 128, G, t), q.device)
    kl = get_kernel("sparse_kl", kl_cfg, q.device)
    kl_args = sf._kl_args(qp, kp, q, k, kl_plan, scale)
    out = torch.empty_like(q)
    lse = torch.empty((B, H, S), dtype=torch.float32, device="cuda")
    comb = get_kernel("sparse_combine", sf.combine_config("bf16", D, 128, G, t), q.device)
    comb_kl = get_kernel("sparse_combine_kl", sf.combine_kl_config(128), q.device)
    lse_p, kl_rows = (torch.empty((B, Hp, S), dtype=torch.float32, device="cuda") for _ in range(2))

    stages = {
        "plan": lambda: sparse_plan(sel, 128, S, G, sf.TILE_M // G, t.tiles_per_item),
        "fwd_kernel": lambda: fwd(q=q, k=k, v=v, o_part=o_part, lse_part=lse_part, scale=scale, hp=Hp,
                                  hp_per_hk=Hp // Hk, **sf._plan_args(plan)),
        "combine": lambda: comb(block_indices=sel, o_part=o_part, lse_part=lse_part, out=out, lse=lse,
                                query_offset=0),
        "kl_kernel": lambda: kl(lse=lse, kl_part=kl_part, **kl_args),
        "combine_kl": lambda: comb_kl(block_indices=sel, kl_part=kl_part, lse_proxy=lse_p, kl_rows=kl_rows,
                                      query_offset=0),
        "combine_kl_torch": lambda: combine_kl_lse(kl_plan, sel, kl_part),  # what ran before the kernel
        "whole": lambda: sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale),
    }
    grad_out = torch.randn_like(q)
    kl_grad = torch.full((), 1.0 / (B * Hp * S), device="cuda")
    fwd_out = sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    stages["backward"] = lambda: msa_backward_cuda(qp, kp, q, k, v, fwd_out[0], fwd_out[1], fwd_out[2], sel, 128,
                                                   scale, grad_out, kl_grad)
    # Backward FLOPs: main 10*D*nnz plus the proxy KL backward 6*Dp*nnz_p (nnz_p = nnz / G).
    bwd_flops = 10 * D * nnz + 6 * D * (nnz // G)
    row = {"config": cfg, "B": B, "S": S, "H": H, "Hk": Hk, "Hp": Hp, "Hpk": Hpk, "G": G, "K": K,
           "nnz": nnz, "fwd_flops": flops, "bwd_flops": bwd_flops, "items": int(plan.items.shape[0])}
    for name, fn in stages.items():
        ms = cuda_time_ms(fn, warmup=2, reps=5)
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops_vs_fwd_flops"] = flops / ms / 1e9
    row["backward_tflops"] = bwd_flops / row["backward_ms"] / 1e9
    torch.cuda.synchronize()
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="8192,32768,65536")
    ap.add_argument("--configs", default="a,b,c")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--out", default=None)
    ap.add_argument("--mma", default="auto", help="the sparse_fwd and sparse_kl kernels of the stage timing: auto "
                    "(the ones the runtime picks), sync or wgmma (sm90a); comma-separated for both in one run")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sparse_fwd: no CUDA device", file=sys.stderr)
        return 2
    print("effective TFLOPS = 4*D*nnz / time (main forward FLOPs, msa-semantics.md); floor at "
          f"{PEAK_TFLOPS:.0f} TFLOP/s")
    rows = []
    for cfg in a.configs.split(","):
        for S, mma in ((int(s), m) for s in a.seqlens.split(",") for m in a.mma.split(",")):
            torch.cuda.reset_peak_memory_stats()
            r = dict(run(cfg, S, a.tokens, mma), mma=mma)
            rows.append(r)
            print(f"({cfg}) S={S:6d} B={r['B']:2d} mma={mma} items={r['items']:7d} | "
                  + " ".join(f"{n}={r[n + '_ms']:.2f}ms" for n in ("plan", "fwd_kernel", "combine", "kl_kernel",
                                                                  "combine_kl", "combine_kl_torch", "whole",
                                                                  "backward"))
                  + f" | fwd kernel {r['fwd_kernel_tflops_vs_fwd_flops']:.0f} TF/s, whole "
                  f"{r['whole_tflops_vs_fwd_flops']:.0f} TF/s, backward {r['backward_tflops']:.0f} TF/s, "
                  f"peak {r['peak_gib']:.1f} GiB", flush=True)
            torch.cuda.empty_cache()
    payload = {"commit": commit(), "device": torch.cuda.get_device_name(), "rows": rows,
               "formula": "effective TFLOPS = 4*D*nnz / ms"}
    if a.out:
        Path(a.out).write_text(__import__("json").dumps(payload, indent=1))
    else:
        write_results("sparse_fwd", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
