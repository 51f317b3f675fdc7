"""A/B of the chunked forward and backward on one stream against overlapped on side streams
(flash_msa_rt/ops/overlap.py), in one process on the same selection and inputs. Variants: "serial" (OVERLAP off:
every chunk's plan, kernels and combine in turn on the caller's stream), "share:F" (overlapped, two partial / tau
buffers of F x the runtime's budget each: 0.5 keeps the peak memory, 1.0 doubles the buffers for fewer chunks).
Per configuration and variant: msa_forward_cuda and msa_backward_cuda in ms (median of reps, variants
interleaved), their peak memory beyond what was allocated before the call, the chunk counts, and whether the
forward's outputs are bitwise those of the serial run (the backward's atomics vary in order: its largest difference
relative to the gradient's largest entry).

    python benchmarks/ab_overlap.py [b:65536,a:65536:1] [reps] [serial,share:0.5,share:1.0]
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.common import commit  # noqa: E402


def set_variant(name: str) -> None:
    from flash_msa_rt.ops import sparse_fwd as sf

    sf.OVERLAP = name != "serial"
    if name.startswith("share:"):
        sf.OVERLAP_SHARE = float(name.split(":")[1])


def timed(fn) -> tuple[float, float, object]:
    """(ms, peak GiB beyond the memory allocated before the call, result) of one fn() call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), (torch.cuda.max_memory_allocated() - base) / 2 ** 30, result


def main():
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops.select import select_blocks_cuda

    specs = sys.argv[1].split(",") if len(sys.argv) > 1 else ["b:65536", "a:65536", "c:65536", "b:16384"]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["serial", "share:0.5", "share:1.0"]
    print(f"commit {commit()}, {torch.cuda.get_device_name()}, reps {reps}")
    for spec in specs:
        cfg, S, *batch = spec.split(":")  # cfg:S or cfg:S:B (default B * S = 128K tokens)
        x = random_problem(cfg, int(S), int(S) * int(batch[0]) if batch else 131072)
        B, S, H, Hk, Hp, Hpk, D, G, scale = (x[n] for n in ("B", "S", "H", "Hk", "Hp", "Hpk", "D", "G", "scale"))
        qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
        sel = select_blocks_cuda(qp, kp, 16, 128, scale)
        go = torch.randn_like(q)
        kl_grad = torch.full((), 1.0 / (B * Hp * S), device="cuda")

        def forward():
            return sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)

        times = {n: {"fwd": [], "bwd": [], "fwd_peak": 0.0, "bwd_peak": 0.0} for n in names}
        results = {}
        for rep in range(reps + 1):  # the first round warms every variant up
            for n in names:
                set_variant(n)
                ms_f, peak_f, fwd_out = timed(forward)
                ms_b, peak_b, grads = timed(lambda: sb.msa_backward_cuda(qp, kp, q, k, v, *fwd_out[:3], sel, 128,
                                                                          scale, go, kl_grad))
                if rep == 0:
                    results[n] = (fwd_out, grads)
                    continue
                t = times[n]
                t["fwd"].append(ms_f)
                t["bwd"].append(ms_b)
                t["fwd_peak"], t["bwd_peak"] = max(t["fwd_peak"], peak_f), max(t["bwd_peak"], peak_b)
                del fwd_out, grads
        set_variant("serial")
        base_f, base_b = results[names[0]]
        print(f"({cfg}) S={S} B={B}:")
        for n in names:
            set_variant(n)
            budget = sf.partials_budget(B, S, H, D)
            if n != "serial":
                budget = int(budget * sf.OVERLAP_SHARE)
            fchunks = -(-S // sf.query_chunk(B, S, Hp, 16, G, D, 128, budget))
            t = times[n]
            f, b = statistics.median(t["fwd"]), statistics.median(t["bwd"])
            fwd_out, grads = results[n]
            same = all(torch.equal(a, c) for a, c in zip(fwd_out, base_f))
            diff = max(float((g.float() - h.float()).abs().max() / h.float().abs().max().clamp(min=1e-30))
                       for g, h in zip(grads, base_b))
            print(f"  {n:10s} fwd {f:7.2f} ms (peak {t['fwd_peak']:5.2f} GiB, {fchunks} chunks)  bwd {b:7.2f} ms "
                  f"(peak {t['bwd_peak']:5.2f} GiB)  fwd+bwd {f + b:7.2f} ms  fwd bitwise = serial: {same}, "
                  f"grads max rel diff {diff:.1e}", flush=True)
        set_variant("share:0.5")
        del results, base_f, base_b
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
