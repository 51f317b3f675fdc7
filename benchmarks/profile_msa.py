"""Where the whole sparse op's time goes, beyond its kernels: one forward + backward under torch.profiler (every
kernel and torch op on the device, by total CUDA time), the forward at several partial-buffer budgets (query
chunks against peak memory; the runtime's is tuning.sparse_fwd's partials_budget), and the backward's
delta = rowsum(dO * O) computed two ways.
Usage: python benchmarks/profile_msa.py [config a|b|c] [S] [--budgets 1,2,4,8] [--tokens B*S] [--out FILE]
(B*S = 128K tokens unless --tokens; --tokens S gives B = 1; --budgets "" skips the budget sweep).
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


def delta_float(go, out):
    """The backward's delta as the runtime computes it: fp32 copies of both, then the row sums."""
    return (go.float() * out.float()).sum(-1)


def delta_bmm(go, out):
    """The same row dot products as (1 x D) @ (D x 1) products with fp32 output: no fp32 copies of dO and O."""
    n, d = go.numel() // go.shape[-1], go.shape[-1]
    return torch.bmm(go.reshape(n, 1, d), out.reshape(n, d, 1), out_dtype=torch.float32).view(go.shape[:-1])


def main(argv=None):
    from flash_msa_rt.ops import sparse_fwd as sf
    from flash_msa_rt.ops.select import select_blocks_cuda
    from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="b")
    ap.add_argument("S", nargs="?", type=int, default=65536)
    ap.add_argument("--budgets", default="1,2,4,8", help="partial-buffer budgets to time the forward at, in GiB")
    ap.add_argument("--tokens", type=int, default=131072, help="B*S (B = tokens // S, at least 1)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    x = random_problem(a.config, a.S, tokens=a.tokens)
    B, S, H, Hk, Hp, Hpk, D, G, scale = (x[n] for n in ("B", "S", "H", "Hk", "Hp", "Hpk", "D", "G", "scale"))
    qp, kp, q, k, v = (x[n] for n in ("qp", "kp", "q", "k", "v"))
    sel = select_blocks_cuda(qp, kp, 16, 128, scale)
    go = torch.randn_like(q)
    kl_grad = torch.full((), 1.0 / (B * Hp * S), device="cuda")
    result = {"commit": commit(), "device": torch.cuda.get_device_name(), "config": a.config, "B": B, "S": S}

    def forward():
        return sf.msa_forward_cuda(qp, kp, q, k, v, sel, 128, scale)

    out, lse, lse_p, _ = forward()

    def backward():
        return msa_backward_cuda(qp, kp, q, k, v, out, lse, lse_p, sel, 128, scale, go, kl_grad)

    # The forward at each budget: fewer, larger chunks against the memory one chunk's partials take.
    from flash_msa_rt import tuning
    from flash_msa_rt.ops.device import arch_of

    default = sf.choice(arch_of(q.device), G, D, 128, B, S, H).partials_budget
    result["runtime_budget_gib"] = default / 2 ** 30
    print(f"the runtime's budget here: {result['runtime_budget_gib']:.2f} GiB")
    result["budgets"] = []
    for gib in (float(x) for x in a.budgets.split(",") if x):
        nbytes = int(gib * 2 ** 30)
        heads, chunk = sf.forward_chunks(B, S, Hp, Hk, Hpk, 16, G, D, 128, nbytes)
        n_chunks = (Hp // heads) * -(-S // chunk)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with tuning.override(sparse_fwd={"partials_budget": nbytes}):
            ms = cuda_time_ms(forward, warmup=1, reps=3)
        extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        result["budgets"].append({"budget_gib": gib, "chunks": n_chunks, "forward_ms": ms,
                                  "forward_extra_peak_gib": extra})
        print(f"partials budget {gib:4.1f} GiB: {n_chunks:3d} chunks, forward {ms:7.2f} ms, "
              f"peak beyond the inputs {extra:5.2f} GiB", flush=True)

    # delta two ways, against float64.
    exact = (go.double() * out.double()).sum(-1)
    result["delta"] = {}
    for name, fn in (("float copies", delta_float), ("bmm out_dtype=float32", delta_bmm)):
        try:
            got = fn(go, out)
        except (RuntimeError, TypeError) as e:  # an older torch without bmm's out_dtype
            print(f"delta ({name}): {e}")
            continue
        ms = cuda_time_ms(lambda fn=fn: fn(go, out), warmup=2, reps=5)
        err = float((got.double() - exact).abs().max())
        result["delta"][name] = {"ms": ms, "max_abs_err_vs_f64": err}
        print(f"delta ({name}): {ms:.2f} ms, max |error| vs float64 {err:.2e}", flush=True)

    # Everything on the device in one forward + backward, by total CUDA time.
    backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        forward()
        backward()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=60)
    print(table)
    result["profile_table"] = table
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
