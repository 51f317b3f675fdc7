"""A/B of sparse_bwd (main backward, wgmma) cubins built from different sources, in one process on the same plan
and inputs: each variant is an artifact directory (built with `python -m build_tools build --out DIR`), the first
one the baseline. Prints ms, TFLOP/s of 10*D*nnz and the relative max difference of dq, dk, dv to the baseline.

    python benchmarks/ab_sparse_bwd.py old=/tmp/art_old,new=artifacts b:65536,c:65536 [reps]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import nnz_of, random_problem  # noqa: E402
from benchmarks.common import cuda_time_ms  # noqa: E402


def main():
    from flash_msa_rt import artifacts
    from flash_msa_rt.loader import Kernel, device_arch
    from flash_msa_rt.manifest import variant_name
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_plan import sparse_plan

    arch = device_arch(0)
    dirs = dict(v.split("=", 1) for v in sys.argv[1].split(","))
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    mans = {n: artifacts.load_manifest(Path(d), arch) for n, d in dirs.items()}
    for spec in sys.argv[2].split(","):
        cfg, S = spec.split(":")
        x = random_problem(cfg, int(S))
        B, S, H, Hk, Hp, D, G, scale = (x[n] for n in ("B", "S", "H", "Hk", "Hp", "D", "G", "scale"))
        qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
        sel = select_blocks_cuda(qp, kp, 16, 128, scale)
        nnz = nnz_of(sel, S, G)
        out, lse, _, _ = sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
        go = torch.randn_like(q)
        delta = (go.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
        plan = sparse_plan(sel, 128, S, G, sb.TILE_M // G, sb.TILES_PER_ITEM)
        name = variant_name("sparse_bwd", sb.kernel_config("bf16", D, 128, G, "wgmma"), arch)
        res = {}
        for n in [m for _ in range(reps) for m in dirs]:
            kern = Kernel(mans[n].variants[name], 0, Path(dirs[n]) / arch)
            accs = [torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in (q, k, v)]
            fn = lambda: kern(q=q, k=k, v=v, dout=go, lse=lse, delta=delta, entry_query=plan.entry_query,  # noqa: E731
                              items=plan.items, dq_acc=accs[0], dk_acc=accs[1], dv_acc=accs[2], scale=scale, hp=Hp,
                              hp_per_hk=Hp // Hk)
            fn()
            torch.cuda.synchronize()
            got = [a.clone() for a in accs]
            t = cuda_time_ms(fn, warmup=2, reps=7)
            res[n] = (min(t, res[n][0]) if n in res else t, got)
        base_t, base = next(iter(res.values()))
        rel = lambda a, b: ((a - b).abs().max() / a.abs().max()).item()  # noqa: E731
        print(f"({cfg}) S={S} G={G}: " + "  ".join(
            f"{n} {t:.2f} ms {10 * D * nnz / t / 1e9:.0f} TF (x{base_t / t:.2f}, rel d dq/dk/dv "
            + "/".join(f"{rel(a, b):.1e}" for a, b in zip(base, got)) + ")" for n, (t, got) in res.items()),
            flush=True)


if __name__ == "__main__":
    main()
