"""A tuning choice measured: the public op's forward + backward step (profile_api.api_step, as bench_msa times it)
under the defaults and under tuning overrides, interleaved round by round in one process (the card's clock under
its power cap and the host drift between runs by more than most choices move a step), with each setting's peak
memory. Every tuning policy's why-comment cites a run of this or of a benchmark like it.
Usage: python benchmarks/ab_tuning.py cfg:S[:B] [...] --against JSON [--kl-value deferred] [--select-precision fp8]
       [--rounds 3] [--reps 3] [--out FILE]
e.g. --against '{"sparse_bwd": {"tau_budget": 2147483648}}' (B * S = 128K tokens unless B is given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import commit, flushed_event_times  # noqa: E402
from benchmarks.profile_api import api_step  # noqa: E402


def ab_rounds(step, against: dict, rounds: int, reps: int) -> dict:
    """Per setting ("defaults", "against"): each round's median flushed step ms, the medians over the rounds, and
    the peak memory of one step (torch's allocator, after a reset)."""
    from flash_msa_rt import tuning

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    settings = {"defaults": {}, "against": against}
    out = {name: {"step_ms": []} for name in settings}
    for name, overrides in settings.items():  # untimed first calls (loading, allocator growth)
        with tuning.override(**overrides):
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            out[name]["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
    for _ in range(rounds):
        for name, overrides in settings.items():
            with tuning.override(**overrides):
                out[name]["step_ms"].append(statistics.median(flushed_event_times(step, reps, flush)))
    for row in out.values():
        row["step_ms_median"] = statistics.median(row["step_ms"])
    out["ratio"] = out["against"]["step_ms_median"] / out["defaults"]["step_ms_median"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--against", type=json.loads, required=True, help="tuning overrides (JSON), as tuning.override")
    ap.add_argument("--kl-value", default="exact", choices=("exact", "deferred", "none"))
    ap.add_argument("--select-precision", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="timed steps per setting and round (median)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    result = dict(benchmark="ab_tuning", commit=commit(), device=torch.cuda.get_device_name(), against=a.against,
                  kl_value=a.kl_value, select_precision=a.select_precision, rounds=a.rounds, reps=a.reps,
                  method="CUDA events around each public fwd + bwd step, the L2 flushed before each outside the "
                         "events; per round the median of --reps steps, settings interleaved round by round",
                  problems={})
    for spec in a.specs:
        x, step = api_step(spec, a.kl_value, a.select_precision)
        r = ab_rounds(step, a.against, a.rounds, a.reps)
        result["problems"][spec] = r
        print(f"{spec} (B={x['B']}): defaults {r['defaults']['step_ms_median']:.2f} ms "
              f"{r['defaults']['step_ms']}, against {r['against']['step_ms_median']:.2f} ms {r['against']['step_ms']}"
              f" ({r['ratio']:.3f}x); peak {r['defaults']['peak_mem_bytes'] / 1e9:.2f} against "
              f"{r['against']['peak_mem_bytes'] / 1e9:.2f} GB", flush=True)
        del x, step
        torch.cuda.empty_cache()
        if a.out:
            a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
