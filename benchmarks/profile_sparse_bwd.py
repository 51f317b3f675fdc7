"""Stage times of the sparse backward (delta, plan, sparse_bwd, sparse_bwd_proxy) for one configuration.
Usage: python benchmarks/profile_sparse_bwd.py [config a|b|c] [S] (B*S = 128K tokens)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import nnz_of, random_problem  # noqa: E402
from benchmarks.common import cuda_time_ms  # noqa: E402


def main():
    from flash_msa_rt.loader import device_arch, get_kernel
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda
    from flash_msa_rt.ops.sparse_plan import sparse_plan

    cfg = sys.argv[1] if len(sys.argv) > 1 else "a"
    S = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
    x = random_problem(cfg, S)
    B, S, H, Hk, Hp, Hpk, D, G, scale = (x[n] for n in ("B", "S", "H", "Hk", "Hp", "Hpk", "D", "G", "scale"))
    qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
    sel = select_blocks_cuda(qp, kp, 16, 128, scale)
    nnz = nnz_of(sel, S, G)
    out, lse, lse_p, _ = msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    go = torch.randn_like(q)
    plan = sparse_plan(sel, 128, S, G, sb.TILE_M // G, sb.tiles_per_item(G))
    f32 = torch.float32
    dq, dk, dv = (torch.zeros(t.shape, dtype=f32, device="cuda") for t in (q, k, v))
    dqp, dkp = (torch.zeros(t.shape, dtype=f32, device="cuda") for t in (qp, kp))
    delta = (go.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    klg = torch.full((B, Hp, S), 1e-6, device="cuda")
    mmas = ["sync", "wgmma"] if device_arch(q.device.index or 0) == "sm90a" else ["sync"]
    main = {m: get_kernel("sparse_bwd", sb.kernel_config("bf16", D, 128, G, m), q.device) for m in mmas}
    prox = {m: get_kernel("sparse_bwd_proxy", sb.proxy_config("bf16", D, 128, G, m), q.device) for m in mmas}
    stages = {
        "delta (torch, fp32 copies)": lambda: (go.float() * out.float()).sum(-1).transpose(1, 2).contiguous(),
        "delta (bwd_delta kernel)": lambda: get_kernel("bwd_delta", sb.delta_config("bf16", D), q.device)(
            dout=go, out=out, delta=delta),
        "plan": lambda: sparse_plan(sel, 128, S, G, sb.TILE_M // G, sb.tiles_per_item(G)),
        "zeros": lambda: [torch.zeros(t.shape, dtype=f32, device="cuda") for t in (q, k, v, qp, kp)],
    }
    for m, kernel in main.items():
        stages[f"sparse_bwd ({m})"] = (
            lambda kernel=kernel: kernel(q=q, k=k, v=v, dout=go, lse=lse, delta=delta, entry_query=plan.entry_query,
                                         items=plan.items, dq_acc=dq, dk_acc=dk, dv_acc=dv, scale=scale, hp=Hp,
                                         hp_per_hk=Hp // Hk))
    proxy_plan = sparse_plan(sel, 128, S, G, sb.TILE_M, sf.per_group_tiles(sb.PROXY_MAIN_TILES_PER_ITEM, G))
    for m, kernel in prox.items():
        stages[f"sparse_bwd_proxy ({m})"] = (
            lambda kernel=kernel: kernel(q=q, k=k, q_proxy=qp, k_proxy=kp, entry_query=proxy_plan.entry_query,
                                         items=proxy_plan.items, lse=lse, lse_proxy=lse_p, kl_grad=klg,
                                         dqp_acc=dqp, dkp_acc=dkp, scale=scale, hp_per_hk=Hp // Hk,
                                         hp_per_hpk=Hp // Hpk))
    print(f"config ({cfg}) B={B} S={S} nnz={nnz}: main bwd FLOPs 10*D*nnz = {10 * D * nnz:.3e}")
    for name, fn in stages.items():
        ms = cuda_time_ms(fn, warmup=2, reps=5)
        print(f"  {name:26s} {ms:8.2f} ms   {10 * D * nnz / ms / 1e9:7.0f} TF/s of the main bwd FLOPs", flush=True)


if __name__ == "__main__":
    main()
