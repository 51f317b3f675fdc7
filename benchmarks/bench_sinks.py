"""What attention sinks cost (issue 58): the public op's forward + backward step with a learned sink per main head
against the same call without, interleaved round by round in one process (the card's clock drifts by more than the
difference), deferred KL, bf16 selection, 128K tokens per step unless B is given.

With sinks the forward's combine scales out in its merge (no pass of its own), and the backward adds one row pass
(the bwd_delta kernel's scale_rows variant: reads dO and out, writes dO' = (1 - p_sink) dO and delta for d sinks);
the kernels' fused tau backward runs as without sinks (flash_msa_rt.ops.sinks). The floor of that pass, per step:
2 reads + 1 write of (B, S, H, D) at 2 bytes over the card's bandwidth, printed beside each problem.

Usage: python benchmarks/bench_sinks.py a:16384 b:65536 c:131072 ... [--rounds 5] [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sparse_fwd import random_problem  # noqa: E402
from benchmarks.common import commit, flushed_event_times  # noqa: E402

TOP_K = 2048
BANDWIDTH_BYTES_S = 3.35e12  # H100 SXM HBM3 (the H200's 4.8e12 makes the floor smaller)
SETTINGS = ("none", "sinks")


def sink_steps(spec: str, kl_value: str = "deferred"):
    """(problem, {"none": step, "sinks": step}) of "cfg:S[:B]": one flash_msa_func forward + torch.autograd.grad
    over the five inputs and, with sinks, the (H,) float32 sink logits (randn: p_sink between ~0.05 and ~0.9)."""
    from flash_msa_rt import flash_msa_func

    cfg, S, *batch = spec.split(":")
    x = random_problem(cfg, int(S), int(S) * int(batch[0]) if batch else 131072)
    B, S, H, D = x["B"], x["S"], x["H"], x["D"]
    leaves = [x[n].detach().requires_grad_() for n in ("qp", "kp", "q", "k", "v")]
    sinks = torch.randn(H, device="cuda", dtype=torch.float32).requires_grad_()
    dout = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16)
    metric = torch.zeros((), device="cuda") if kl_value == "deferred" else None

    def step(with_sinks: bool):
        def run():
            extra = dict(sinks=sinks) if with_sinks else {}
            out, kl = flash_msa_func(*leaves, top_k=TOP_K, layout="bshd", kl_value=kl_value, kl_metric=metric,
                                     **extra)
            wrt = leaves + [sinks] if with_sinks else leaves
            return torch.autograd.grad((out, kl), wrt, (dout, torch.ones_like(kl)))
        return run

    return x, {"none": step(False), "sinks": step(True)}


def interleaved(steps: dict, rounds: int, reps: int) -> dict:
    """Per setting: each round's median flushed step ms and the median over rounds; ratio = sinks / none."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for step in steps.values():  # untimed first calls (loading, allocator growth)
        step()
        step()
    torch.cuda.synchronize()
    out = {name: {"step_ms": []} for name in SETTINGS}
    for _ in range(rounds):
        for name in SETTINGS:
            out[name]["step_ms"].append(statistics.median(flushed_event_times(steps[name], reps, flush)))
    for row in out.values():
        row["step_ms_median"] = statistics.median(row["step_ms"])
    out["ratio"] = out["sinks"]["step_ms_median"] / out["none"]["step_ms_median"]
    return out


def kernel_diff(steps: dict, n: int = 3) -> list[dict]:
    """Device ms per step of each kernel with and without sinks (profile_api.kernel_table), the rows that differ
    by more than 0.05 ms, largest difference first: where the sinks' time goes."""
    from benchmarks.profile_api import kernel_table

    tables = {name: {r["name"]: r["ms"] for r in kernel_table(steps[name], n)["kernels"]} for name in SETTINGS}
    names = set(tables["none"]) | set(tables["sinks"])
    rows = [dict(name=k[:120], none_ms=tables["none"].get(k, 0.0), sinks_ms=tables["sinks"].get(k, 0.0)) for k in names]
    rows = [r for r in rows if abs(r["sinks_ms"] - r["none_ms"]) > 0.05]
    return sorted(rows, key=lambda r: r["none_ms"] - r["sinks_ms"])


def elementwise_floor_ms(B: int, S: int, H: int, D: int) -> float:
    """The sink row pass's bytes over the bandwidth: dO and out read, dO' written."""
    return 3 * 2 * B * S * H * D / BANDWIDTH_BYTES_S * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--kl-value", default="deferred", choices=("exact", "deferred", "none"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="timed steps per setting and round (median)")
    ap.add_argument("--profile", action="store_true", help="also each kernel's device ms with and without sinks")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    result = dict(benchmark="bench_sinks", commit=commit(), device=torch.cuda.get_device_name(),
                  kl_value=a.kl_value, rounds=a.rounds, reps=a.reps, top_k=TOP_K,
                  method="CUDA events around each public fwd + bwd step, the L2 flushed before each outside the "
                         "events; per round the median of --reps steps, settings interleaved round by round",
                  floor="3 * 2 bytes * B*S*H*D / 3.35e12 B/s (the sink row pass's traffic on an H100)",
                  problems={})
    for spec in a.specs:
        x, steps = sink_steps(spec, a.kl_value)
        r = interleaved(steps, a.rounds, a.reps)
        r.update(B=x["B"], S=x["S"], H=x["H"], D=x["D"],
                 floor_ms=elementwise_floor_ms(x["B"], x["S"], x["H"], x["D"]))
        if a.profile:
            r["kernels"] = kernel_diff(steps)
            for k in r["kernels"]:
                print(f"  {k['sinks_ms'] - k['none_ms']:+7.2f} ms  {k['none_ms']:7.2f} -> {k['sinks_ms']:7.2f}  "
                      f"{k['name'][:90]}")
        result["problems"][spec] = r
        print(f"{spec} (B={x['B']}): none {r['none']['step_ms_median']:.2f} ms, sinks "
              f"{r['sinks']['step_ms_median']:.2f} ms ({(r['ratio'] - 1) * 100:+.1f} %; the sink pass's floor "
              f"{r['floor_ms']:.2f} ms)", flush=True)
        del x, steps
        torch.cuda.empty_cache()
        if a.out:
            a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
