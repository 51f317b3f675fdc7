"""Tiles per work item, swept per sparse kernel (a runtime plan parameter: no rebuild). A larger item loads its key
block once for more tiles (and keeps dk / dv in registers longer in the backward) but makes fewer, longer CTAs whose
tail is a larger share of the grid.
Usage: python benchmarks/sweep_items.py [config a|b|c] [S] [--out FILE] (B*S = 128K tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.common import commit, cuda_time_ms  # noqa: E402

SWEEP = (2, 4, 8, 16, 32)


def main(argv=None):
    from flash_msa_rt.loader import get_kernel
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_plan import sparse_plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="b")
    ap.add_argument("S", nargs="?", type=int, default=65536)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    x = random_problem(a.config, a.S)
    B, S, H, Hk, Hp, Hpk, D, G, scale = (x[n] for n in ("B", "S", "H", "Hk", "Hp", "Hpk", "D", "G", "scale"))
    qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
    sel = select_blocks_cuda(qp, kp, 16, 128, scale)
    dev = q.device
    out, lse, lse_p, _ = sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
    go = torch.randn_like(q)
    delta = (go.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    f32 = torch.float32
    dq, dk, dv = (torch.zeros(t.shape, dtype=f32, device=dev) for t in (q, k, v))
    dqp, dkp = (torch.zeros(t.shape, dtype=f32, device=dev) for t in (qp, kp))
    klg = torch.full((B, Hp, S), 1e-6, device=dev)
    E = B * Hp * S * 16
    o_part = torch.empty((E, G, D), dtype=q.dtype, device=dev)
    lse_part = torch.empty((E, G), dtype=f32, device=dev)
    kl_cfg = sf.kl_config("bf16", D, 128, G, sf.device_mma(dev, "sparse_kl"))
    kl_part = torch.empty((E, 3 * sf.kl_part_groups(kl_cfg)), dtype=f32, device=dev)
    k_fwd = get_kernel("sparse_fwd", sf.kernel_config("bf16", D, 128, G, sf.device_mma(dev, "sparse_fwd")), dev)
    k_kl = get_kernel("sparse_kl", kl_cfg, dev)
    k_bwd = get_kernel("sparse_bwd", sb.kernel_config("bf16", D, 128, G, sf.device_mma(dev, "sparse_bwd")), dev)
    k_prox = get_kernel("sparse_bwd_proxy", sb.proxy_config("bf16", D, 128, G, sf.device_mma(dev, "sparse_bwd_proxy")),
                        dev)

    def fwd(plan):
        k_fwd(q=q, k=k, v=v, o_part=o_part, lse_part=lse_part, scale=scale, hp=Hp, hp_per_hk=Hp // Hk,
              entry_query=plan.entry_query, entry_dest=plan.entry_dest, items=plan.items)

    def kl(plan):
        k_kl(lse=lse, kl_part=kl_part, **sf._kl_args(qp, kp, q, k, plan, scale))

    def bwd(plan):
        k_bwd(q=q, k=k, v=v, dout=go, lse=lse, delta=delta, entry_query=plan.entry_query, items=plan.items,
              dq_acc=dq, dk_acc=dk, dv_acc=dv, scale=scale, hp=Hp, hp_per_hk=Hp // Hk)

    def prox(plan):
        k_prox(q=q, k=k, q_proxy=qp, k_proxy=kp, entry_query=plan.entry_query, items=plan.items, lse=lse,
               lse_proxy=lse_p, kl_grad=klg, dqp_acc=dqp, dkp_acc=dkp, scale=scale, hp_per_hk=Hp // Hk,
               hp_per_hpk=Hp // Hpk)

    # (kernel, launch, queries per tile, what the runtime ships, how the runtime turns T into the plan's T)
    kernels = (("sparse_fwd", fwd, sf.TILE_M // G, sf.TILES_PER_ITEM),
               ("sparse_kl", kl, sf.KL_TILE, sf.per_group_tiles(sf.KL_MAIN_TILES_PER_ITEM, G)),
               ("sparse_bwd", bwd, sb.TILE_M // G, sb.tiles_per_item(G)),
               ("sparse_bwd_proxy", prox, sb.TILE_M, sf.per_group_tiles(sb.PROXY_MAIN_TILES_PER_ITEM, G)))
    result = {"commit": commit(), "device": torch.cuda.get_device_name(), "config": a.config, "B": B, "S": S,
              "G": G, "rows": []}
    print(f"config ({a.config}) B={B} S={S} G={G}: kernel ms by tiles per item (plan T; * = shipped)")
    for name, launch, tq, shipped in kernels:
        cells = []
        for T in sorted(set(SWEEP) | {shipped}):
            plan = sparse_plan(sel, 128, S, G, tq, T)
            ms = cuda_time_ms(lambda plan=plan: launch(plan), warmup=1, reps=3)
            result["rows"].append({"kernel": name, "tiles_per_item": T, "ms": ms, "shipped": T == shipped})
            cells.append(f"T={T}{'*' if T == shipped else ''}: {ms:.2f}")
        print(f"  {name:18s} " + "  ".join(cells), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
