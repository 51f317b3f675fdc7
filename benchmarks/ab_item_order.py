"""A/B of the order in which a plan's work items are launched, in one process on the same selection and inputs:
"list" (list-major: bp, then key block j, then chunk; what sparse_plan and chunk_plans give) against "size" (the
same items, longest first: a chunk's grid then ends on its shortest items, so the last wave's tail is short; the
longest-processing-time-first rule). Items are only reordered, never changed, so the forward's outputs must be
bitwise those of list order. Per configuration and order: msa_forward_cuda and msa_backward_cuda in ms (median of
reps, orders interleaved) and the kernels' CUDA time by family (torch profiler, one call).

    python benchmarks/ab_item_order.py [b:65536,a:65536:1] [reps]
"""

import dataclasses
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import spec_problem  # noqa: E402
from benchmarks.common import commit, kernel_times  # noqa: E402


def by_size(plan):
    """The plan with its items longest first (stable: equal sizes keep list order); dead items (0 entries) last."""
    order = torch.argsort(plan.items[:, 3], descending=True, stable=True)
    return dataclasses.replace(plan, items=plan.items[order].contiguous())


def use_order(name: str) -> None:
    """Make both launchers plan with items in this order ("list" restores the runtime's own)."""
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops import sparse_plan as sp

    def chunk_plans_by_size(*args, **kwargs):
        return {key: tuple(by_size(p) for p in plans) for key, plans in sp.chunk_plans(*args, **kwargs).items()}

    for mod in (sf, sb):
        mod.chunk_plans = sp.chunk_plans if name == "list" else chunk_plans_by_size


def main():
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import sparse_fwd as sf

    specs = sys.argv[1].split(",") if len(sys.argv) > 1 else ["b:65536", "a:65536", "c:65536", "a:65536:1"]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    orders = ("list", "size")
    print(f"commit {commit()}, {torch.cuda.get_device_name()}, reps {reps}")
    for spec in specs:
        x = spec_problem(spec)  # cfg:S or cfg:S:B (default B * S = 128K tokens)
        cfg, B, S, scale = x["cfg"], x["B"], x["S"], x["scale"]
        qp, kp, q, k, v, sel, go, kl_grad = (x[n] for n in ("qp", "kp", "q", "k", "v", "sel", "go", "kl_grad"))

        def forward():
            return sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)

        def backward(fwd):
            return sb.msa_backward_cuda(qp, kp, q, k, v, *fwd[:3], sel, 128, scale, go, kl_grad)

        ms = {o: {"fwd": [], "bwd": []} for o in orders}
        first, fwd_out = {}, None
        for rep in range(reps + 1):  # round 0 warms both orders up
            for o in orders:
                use_order(o)
                for part in ("fwd", "bwd"):
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    result = forward() if part == "fwd" else backward(fwd_out)
                    end.record()
                    end.synchronize()
                    if part == "fwd":
                        fwd_out = result
                    if rep == 0:
                        first[(o, part)] = result
                    else:
                        ms[o][part].append(start.elapsed_time(end))
        print(f"({cfg}) S={S} B={B}:")
        for o in orders:
            use_order(o)
            f, b = statistics.median(ms[o]["fwd"]), statistics.median(ms[o]["bwd"])
            same = all(torch.equal(a, c) for a, c in zip(first[(o, "fwd")], first[("list", "fwd")]))
            diff = max(float((g.float() - h.float()).abs().max() / h.float().abs().max().clamp(min=1e-30))
                       for g, h in zip(first[(o, "bwd")], first[("list", "bwd")]))
            fwd_out = forward()
            print(f"  {o:5s} fwd {f:7.2f} ms  bwd {b:7.2f} ms  fwd+bwd {f + b:7.2f} ms  fwd bitwise = list order: "
                  f"{same}, grads max rel diff {diff:.1e}", flush=True)
            print(f"        forward kernels (ms): {kernel_times(forward)}", flush=True)
            print(f"        backward kernels (ms): {kernel_times(functools.partial(backward, fwd_out))}", flush=True)
        use_order("list")
        del first
        fwd_out = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
