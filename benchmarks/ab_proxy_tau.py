"""A/B of the sparse backward's two ways to the proxy's tau, in one process on the same selection and inputs:
"tau" (the main backward writes tau per plan entry and the proxy kernel reads it, in query chunks; the runtime's
choice on wgmma with both gradients) against "recompute" (the proxy kernel recomputes tau from the G main heads:
resident at G <= 4, stepped above; what ran before). Per configuration: the whole msa_backward_cuda in ms, its
peak memory beyond what was allocated before the call, and the largest difference of each gradient between the
two relative to its largest entry. Further "tau" variants: artifact directories (python -m build_tools build --out
DIR) whose cubins replace the ones of the tau path that they hold (loaded without the source check, as in
ab_sparse.py), or "budget:N" for the runtime's cubins with a tau budget of N bytes per chunk (TAU_BUDGET and
TAU_FLOOR), timed in the same process.

    python benchmarks/ab_proxy_tau.py [b:65536,c:65536] [reps] [name=dir|budget:N,...]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.common import cuda_time_ms, kernel_times  # noqa: E402

GRADS = ("dq_proxy", "dk_proxy", "dq", "dk", "dv")


def use_artifacts(directory):
    """Make the backward launcher load the variants that directory holds from there (None: the runtime's own)."""
    from flash_msa_rt import artifacts, loader
    from flash_msa_rt.manifest import variant_name
    from flash_msa_rt.ops import sparse_bwd as sb

    if directory is None:
        sb.get_kernel = loader.get_kernel
        return
    arch = loader.device_arch(0)
    manifest = artifacts.load_manifest(Path(directory), arch)
    cache = {}

    def get_kernel(op, config, device):
        name = variant_name(op, config, arch)
        if name not in manifest.variants:
            return loader.get_kernel(op, config, device)
        if name not in cache:
            cache[name] = loader.Kernel(manifest.variants[name], 0, Path(directory) / arch)
        return cache[name]

    sb.get_kernel = get_kernel


def main():
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops.select import select_blocks_cuda

    specs = sys.argv[1].split(",") if len(sys.argv) > 1 else ["a:65536", "b:65536", "c:65536"]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    extra = dict(v.split("=", 1) for v in sys.argv[3].split(",")) if len(sys.argv) > 3 else {}
    for spec in specs:
        cfg, S = spec.split(":")
        x = random_problem(cfg, int(S))
        B, S, Hp, scale = (x[n] for n in ("B", "S", "Hp", "scale"))
        qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
        sel = select_blocks_cuda(qp, kp, 16, 128, scale)
        out, lse, lsep, _ = sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)
        go = torch.randn_like(q)
        klg = torch.rand(B, Hp, S, device=q.device) + 0.5

        def backward():
            return sb.msa_backward_cuda(qp, kp, q, k, v, out, lse, lsep, sel, 128, scale, go, klg)

        results = {}
        modes = [("recompute", "resident", None), ("tau", None, None)] + [(n, None, d) for n, d in extra.items()]
        budget = sb.TAU_BUDGET, sb.TAU_FLOOR
        for name, force, directory in modes:
            sb.FORCE_PROXY_HEADS = force
            sb.TAU_BUDGET, sb.TAU_FLOOR = ((int(directory[7:]),) * 2 if directory and directory.startswith("budget:")
                                           else budget)
            use_artifacts(None if directory is None or directory.startswith("budget:") else directory)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads = backward()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            ms = cuda_time_ms(backward, warmup=1, reps=reps)
            results[name] = (ms, peak, grads)
            print(f"  ({cfg}) {name}: {kernel_times(backward)}", flush=True)
        sb.FORCE_PROXY_HEADS, (sb.TAU_BUDGET, sb.TAU_FLOOR) = None, budget
        use_artifacts(None)
        ms0, peak0, g0 = results["recompute"]
        for name, (ms1, peak1, g1) in results.items():
            if name == "recompute":
                continue
            diffs = " ".join(f"{n} {((a.float() - b.float()).abs().max() / a.float().abs().max()).item():.1e}"
                             for n, a, b in zip(GRADS, g0, g1))
            print(f"({cfg}) S={S} B={B} | recompute {ms0:7.2f} ms peak +{peak0:.2f} GiB | {name} {ms1:7.2f} ms "
                  f"peak +{peak1:.2f} GiB | {ms0 / ms1:.2f}x | max diff / max: {diffs}", flush=True)
        del results, g0
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
