"""A/B of runtime settings in one process on the same selection and inputs: each variant is a list of module
attribute assignments in flash_msa_rt.ops (e.g. "sparse_fwd.FORWARD_CHUNKS=queries"; "base" changes nothing),
applied before its calls and undone after. Per configuration and variant: msa_forward_cuda and msa_backward_cuda in
ms (median of reps, variants interleaved), the host's enqueue time of each call, the peak memory beyond what was
allocated before the call, and whether the forward's outputs are bitwise those of the first variant (the
backward's atomics vary in order: its largest difference relative to each gradient's largest entry).

    python benchmarks/ab_runtime.py [b:65536,a:65536:1] [reps] "base" "sparse_fwd.FORWARD_CHUNKS=queries" ...
"""

import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import spec_problem  # noqa: E402
from benchmarks.common import commit  # noqa: E402


def parse(variant: str) -> list[tuple[object, str, object]]:
    """[(module, attribute, value)] of "mod.ATTR=value,mod.ATTR=value" (values: int, float, or str)."""
    out = []
    for item in filter(None, variant.split(",")):
        if item == "base":
            continue
        target, value = item.split("=", 1)
        mod, attr = target.rsplit(".", 1)
        module = importlib.import_module(f"flash_msa_rt.ops.{mod}")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        out.append((module, attr, value))
    return out


class Applied:
    def __init__(self, settings):
        self.settings, self.saved = settings, []

    def __enter__(self):
        self.saved = [(m, a, getattr(m, a)) for m, a, _ in self.settings]
        for m, a, v in self.settings:
            setattr(m, a, v)

    def __exit__(self, *exc):
        for m, a, v in self.saved:
            setattr(m, a, v)


def timed(fn):
    """(ms, host ms, peak GiB beyond the memory allocated before, result) of one fn() call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    result = fn()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host, (torch.cuda.max_memory_allocated() - base) / 2 ** 30, result


def main():
    from flash_msa_rt.ops import sparse_bwd as sb
    from flash_msa_rt.ops import sparse_fwd as sf

    specs = sys.argv[1].split(",") if len(sys.argv) > 1 else ["b:65536", "a:65536"]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    variants = sys.argv[3:] or ["base"]
    settings = {v: parse(v) for v in variants}
    print(f"commit {commit()}, {torch.cuda.get_device_name()}, reps {reps}")
    for spec in specs:
        x = spec_problem(spec)  # cfg:S or cfg:S:B (default B * S = 128K tokens)
        cfg, B, S, scale = x["cfg"], x["B"], x["S"], x["scale"]
        qp, kp, q, k, v, sel, go, kl_grad = (x[n] for n in ("qp", "kp", "q", "k", "v", "sel", "go", "kl_grad"))
        rows = {n: {"fwd": [], "bwd": [], "hf": [], "hb": [], "pf": 0.0, "pb": 0.0} for n in variants}
        first = {}
        for rep in range(reps + 1):  # round 0 warms every variant up
            for n in variants:
                with Applied(settings[n]):
                    ms_f, host_f, peak_f, fwd = timed(lambda: sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale))
                    ms_b, host_b, peak_b, grads = timed(
                        lambda: sb.msa_backward_cuda(qp, kp, q, k, v, *fwd[:3], sel, 128, scale, go, kl_grad))
                if rep == 0:
                    first[n] = (fwd, grads)
                    continue
                r = rows[n]
                r["fwd"].append(ms_f)
                r["bwd"].append(ms_b)
                r["hf"].append(host_f)
                r["hb"].append(host_b)
                r["pf"], r["pb"] = max(r["pf"], peak_f), max(r["pb"], peak_b)
                del fwd, grads
        print(f"({cfg}) S={S} B={B}:")
        base_f, base_b = first[variants[0]]
        for n in variants:
            r = rows[n]
            med = {key: statistics.median(r[key]) for key in ("fwd", "bwd", "hf", "hb")}
            fwd, grads = first[n]
            same = all(torch.equal(a, c) for a, c in zip(fwd, base_f))
            diff = max(float((g.float() - h.float()).abs().max() / h.float().abs().max().clamp(min=1e-30))
                       for g, h in zip(grads, base_b))
            print(f"  {n}: fwd {med['fwd']:7.2f} ms (host {med['hf']:5.2f}, peak {r['pf']:5.2f} GiB)  bwd "
                  f"{med['bwd']:7.2f} ms (host {med['hb']:5.2f}, peak {r['pb']:5.2f} GiB)  fwd+bwd "
                  f"{med['fwd'] + med['bwd']:7.2f} ms  fwd bitwise = first: {same}, grads max rel diff {diff:.1e}",
                  flush=True)
        del first, base_f, base_b
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
