"""The KL pass kernel (sparse_kl) with 64 keys per CTA (two CTAs per work item) against the whole 128-key block per
CTA, on the same plan and inputs, configurations (a), (b), (c) at S = 64K, B = 2 (B*S = 128K tokens).
Usage: python benchmarks/bench_kl_tiles.py [S]"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import CONFIGS  # noqa: E402
from benchmarks.common import cuda_time_ms  # noqa: E402


def main():
    from flash_msa_rt.loader import get_kernel
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_plan import combine_kl_lse, kl_groups, sparse_plan

    S = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    for name, (H, Hk, Hp, Hpk) in CONFIGS.items():
        B, D, G = max(1, 131072 // S), 128, H // Hp
        torch.manual_seed(0)
        qp, kp = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16) for h in (Hp, Hpk))
        q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = D ** -0.5
        sel = select_blocks_cuda(qp, kp, 16, 128, scale)
        lse = sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)[1]
        plan = sparse_plan(sel, 128, S, G, sf.KL_TILE, max(1, sf.KL_TILES_PER_ITEM // G))
        args = sf._kl_args(qp, kp, q, k, plan, scale)
        results = {}
        for tile_n in (64, 128):
            kl = get_kernel("sparse_kl", dict(sf.kl_config("bf16", D, 128, G), tile_n=tile_n), q.device)
            part = torch.empty((plan.E, 3 * kl_groups(128)), dtype=torch.float32, device="cuda")
            ms = cuda_time_ms(lambda: kl(lse=lse, kl_part=part, **args), warmup=2, reps=5)
            results[tile_n] = (ms, combine_kl_lse(plan, sel, part))
        same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(results[64][1], results[128][1]))
        print(f"({name}) S={S} B={B}: sparse_kl tile_n=64 {results[64][0]:.2f} ms, tile_n=128 {results[128][0]:.2f} "
              f"ms; lse_proxy and kl_rows agree: {same}", flush=True)


if __name__ == "__main__":
    main()
