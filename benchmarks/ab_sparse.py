"""A/B of the sparse kernels' cubins built from different sources, in one process on the same plans and inputs:
select (the whole sequence; TFLOP/s of its 2 Dp Hp B S (S + 1) / 2 FLOPs printed beside it),
sparse_fwd, sparse_combine, sparse_kl (one query chunk of at most 16K queries, as the forward runs them),
sparse_bwd (also as "bwdtau": the variant that writes tau for the proxy kernel) and sparse_bwd_proxy (the whole
sequence; "proxy" recomputes tau, "proxytau" reads the tau rows of the runtime's bwdtau kernel), each with the
variant the runtime picks on this GPU. Each variant is an artifact directory (python -m build_tools build --out
DIR); the first is the baseline. Prints ms per kernel and whether the outputs
are bitwise equal to the baseline's (else the relative max difference).

    python benchmarks/ab_sparse.py old=/tmp/art_old,new=artifacts b:65536,c:65536 \
        [select,fwd,combine,kl,bwd,bwdtau,proxy,proxytau] [reps]
"""

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.common import cuda_time_ms  # noqa: E402


def compare(base, got):
    """'=' when every tensor is bitwise equal (NaN where the baseline has NaN), else the worst relative max
    difference over the tensors' finite entries."""
    worst = 0.0
    for a, b in zip(base, got):
        if torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)):
            continue
        a, b = a.double(), b.double()  # integer outputs (select's block indices) too
        fin = torch.isfinite(a) & torch.isfinite(b)
        scale = a[fin].abs().max().clamp(min=1e-30)
        worst = max(worst, ((a[fin] - b[fin]).abs().max() / scale).item(), float(not torch.equal(
            torch.isfinite(a), torch.isfinite(b))))
    return "=" if worst == 0.0 else f"{worst:.1e}"


def main():
    from flash_msa_rt import artifacts
    from flash_msa_rt.loader import Kernel, device_arch, get_kernel
    from flash_msa_rt.manifest import variant_name
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import select as sel_op
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_plan import recut, sparse_plan

    arch = device_arch(0)
    dev = torch.device("cuda")
    dirs = dict(v.split("=", 1) for v in sys.argv[1].split(","))
    families = sys.argv[3].split(",") if len(sys.argv) > 3 else ["fwd", "kl", "bwd", "proxy"]
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    mans = {n: artifacts.load_manifest(Path(d), arch) for n, d in dirs.items()}
    for spec in sys.argv[2].split(","):
        cfg, S = spec.split(":")
        x = random_problem(cfg, int(S))
        B, S, H, Hk, Hp, D, G, scale = (x[n] for n in ("B", "S", "H", "Hk", "Hp", "D", "G", "scale"))
        qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
        sel = select_blocks_cuda(qp, kp, 16, 128, scale)
        out, lse, lsep, _ = sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
        go = torch.randn_like(q)
        delta = (go.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
        grad = torch.rand(B, Hp, S, device=dev) + 0.5
        chunk = min(S, 16384)
        csel = sel[:, :, :chunk].contiguous()
        fplan = sparse_plan(csel, 128, chunk, G, sf.TILE_M // G, sf.TILES_PER_ITEM)
        kplan = recut(fplan, sf.KL_TILE, sf.per_group_tiles(sf.KL_MAIN_TILES_PER_ITEM, G))
        bplan = sparse_plan(sel, 128, S, G, sb.TILE_M // G, sb.tiles_per_item(G))
        pplan = recut(bplan, sb.TILE_M, sf.per_group_tiles(sb.PROXY_MAIN_TILES_PER_ITEM, G))
        dt = sf.DTYPES[q.dtype]
        confs = {"select": ("select", sel_op.kernel_config(dt, qp.shape[3], 128, 16, sel_op.device_mma(dev))),
                 "fwd": ("sparse_fwd", sf.kernel_config(dt, D, 128, G, sf.device_mma(dev, "sparse_fwd"))),
                 "combine": ("sparse_combine", sf.combine_config(dt, D, 128, G)),
                 "kl": ("sparse_kl", sf.kl_config(dt, D, 128, G, sf.device_mma(dev, "sparse_kl"))),
                 "bwd": ("sparse_bwd", sb.kernel_config(dt, D, 128, G, sf.device_mma(dev, "sparse_bwd"))),
                 "bwdtau": ("sparse_bwd", sb.kernel_config(dt, D, 128, G, "wgmma", tau_out=True)),
                 "proxy": ("sparse_bwd_proxy", sb.proxy_config(dt, D, 128, G, sf.device_mma(dev, "sparse_bwd_proxy"))),
                 "proxytau": ("sparse_bwd_proxy", sb.proxy_config(dt, D, 128, G, "wgmma", "tau", True))}

        def launcher(fam, kern):
            """(outputs, fill value, run) of one family's kernel; run() writes (fwd, kl) or adds to (bwd, proxy)
            the outputs."""
            f32 = dict(dtype=torch.float32, device=dev)
            if fam == "select":
                outs = (torch.empty((B, Hp, S, 16), dtype=torch.int32, device=dev),)
                return outs, -7, lambda: kern(q_proxy=qp, k_proxy=kp, block_indices=outs[0], scale=scale,
                                              group=Hp // kp.shape[2])
            if fam == "fwd":
                outs = (torch.empty((fplan.E, G, D), dtype=q.dtype, device=dev), torch.empty((fplan.E, G), **f32))
                return outs, float("nan"), lambda: kern(q=q, k=k, v=v, o_part=outs[0], lse_part=outs[1], scale=scale,
                                                        hp=Hp, hp_per_hk=Hp // Hk, **sf._plan_args(fplan))
            if fam == "combine":  # the runtime's forward kernel's partials of the chunk
                parts = (torch.empty((fplan.E, G, D), dtype=q.dtype, device=dev), torch.empty((fplan.E, G), **f32))
                get_kernel("sparse_fwd", confs["fwd"][1], dev)(q=q, k=k, v=v, o_part=parts[0], lse_part=parts[1],
                                                               scale=scale, hp=Hp, hp_per_hk=Hp // Hk,
                                                               **sf._plan_args(fplan))
                outs = (torch.empty((B, chunk, H, D), dtype=q.dtype, device=dev), torch.empty((B, H, chunk), **f32))
                return outs, float("nan"), lambda: kern(block_indices=csel, o_part=parts[0], lse_part=parts[1],
                                                        out=outs[0], lse=outs[1], query_offset=0)
            if fam == "kl":
                outs = (torch.empty((kplan.E, 3 * sf.kl_part_groups(confs["kl"][1])), **f32),)
                return outs, float("nan"), lambda: kern(lse=lse, kl_part=outs[0],
                                                        **sf._kl_args(qp, kp, q, k, kplan, scale))
            if fam in ("bwd", "bwdtau"):
                outs = tuple(torch.empty(t.shape, **f32) for t in (q, k, v))
                tau = {}
                if fam == "bwdtau":  # tau rows of live entries only; the rest keep the fill
                    outs += (torch.empty((bplan.E, 128), dtype=q.dtype, device=dev),)
                    tau = dict(tau=outs[3])
                return outs, 0.0, lambda: kern(q=q, k=k, v=v, dout=go, lse=lse, delta=delta,
                                               entry_query=bplan.entry_query, items=bplan.items, dq_acc=outs[0],
                                               dk_acc=outs[1], dv_acc=outs[2], scale=scale, hp=Hp,
                                               hp_per_hk=Hp // Hk, **tau)
            outs = (torch.empty(qp.shape, **f32), torch.empty(kp.shape, **f32))
            if fam == "proxytau":  # tau rows from the runtime's main kernel on the same plan, as the op runs them
                main_outs, _, run_main = launcher("bwdtau", get_kernel("sparse_bwd", confs["bwdtau"][1], dev))
                for o in main_outs:
                    o.zero_()
                run_main()
                tau = main_outs[3]
                return outs, 0.0, lambda: kern(q_proxy=qp, k_proxy=kp, tau=tau, entry_query=pplan.entry_query,
                                               items=pplan.items, lse_proxy=lsep, kl_grad=grad, dqp_acc=outs[0],
                                               dkp_acc=outs[1], scale=scale, hp_per_hpk=Hp // kp.shape[2])
            return outs, 0.0, lambda: kern(q=q, k=k, q_proxy=qp, k_proxy=kp, entry_query=pplan.entry_query,
                                           items=pplan.items, lse=lse, lse_proxy=lsep, kl_grad=grad, dqp_acc=outs[0],
                                           dkp_acc=outs[1], scale=scale, hp_per_hk=Hp // Hk,
                                           hp_per_hpk=Hp // kp.shape[2])

        for fam in families:
            op, conf = confs[fam]
            name = variant_name(op, conf, arch)
            res = {}
            # Each source's variant of this config, or the one it builds with other stages (a change of pipeline
            # depth renames the variant); a source that builds neither is skipped.
            names = {n: name if name in mans[n].variants else next(
                (v for v in mans[n].variants if re.sub(r"_s\d+_", "_s_", v) == re.sub(r"_s\d+_", "_s_", name)),
                None) for n in dirs}
            have = [n for n in dirs if names[n]]
            for n in [m for _ in range(reps) for m in have]:
                kern = Kernel(mans[n].variants[names[n]], 0, Path(dirs[n]) / arch)
                outs, fill, run = launcher(fam, kern)
                for o in outs:
                    o.fill_(fill)
                run()
                torch.cuda.synchronize()
                got = [o.clone() for o in outs]
                t = cuda_time_ms(run, warmup=2, reps=7)  # bwd, proxy: adding to the checked sums
                res[n] = (min(t, res[n][0]) if n in res else t, got)
            base_t, base = next(iter(res.values()))
            flops = 2 * qp.shape[3] * Hp * B * S * (S + 1) / 2 if fam == "select" else 0
            rate = (lambda t: f", {flops / t / 1e9:.0f} TFLOP/s") if flops else (lambda t: "")
            print(f"({cfg}) S={S} G={G} {fam:5s}: " + "  ".join(
                f"{n} {t:.3f} ms (x{base_t / t:.3f}{rate(t)}, {compare(base, got)})" for n, (t, got) in res.items())
                + "".join(f"  {n} absent" for n in dirs if n not in have), flush=True)


if __name__ == "__main__":
    main()
