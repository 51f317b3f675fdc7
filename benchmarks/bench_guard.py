"""What the first-use guard (flash_msa_rt.guard, issue 38) adds to a user's first training step, measured as a user
meets it: pairs of fresh processes run the same first step, one with the guard (this GPU's arch force-marked
unverified, an empty cache) and one without (FLASH_MSA_GUARD=off); the guard's cost is the difference of their
first-step times (median over the pairs). Both processes have done what a model's process has done before its first
attention call: CUDA initialised, cuBLAS used by a projection, and deterministic mode switched once (torch imports
its compiler stack on the first switch, ~4.6 s on the H200 machine: a cost of the user's own call, not the guard's).

The step touches every guard family: MSA (selection, forward, backward), warmup, block-sparse attention, and the MSA
backward under deterministic algorithms. Each guarded process also lists its slices' own times (guard.slices_run).

Run: FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_guard.py --out benchmarks/results/guard_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import commit  # noqa: E402

TARGET_SECONDS = 2.0
REPO = Path(__file__).resolve().parent.parent

_STEP = r"""
import json, time, torch
import flash_msa_rt as F
from flash_msa_rt import guard
dev = "cuda"
torch.zeros(1, device=dev).sum().item()
w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
(w @ w).float().sum().item()  # a projection: cuBLAS is up, as in any model
torch.use_deterministic_algorithms(True, warn_only=True)  # the user's own first switch (torch imports its
torch.use_deterministic_algorithms(False)                 # compiler stack there): outside the timed step
B, S, H, Hk, Hp, Hpk, D = 1, 4096, 16, 4, 4, 1, 128
g = torch.Generator(device=dev).manual_seed(0)
rnd = lambda *s: torch.randn(*s, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
idx = torch.randint(0, S // 128, (B, Hk, S, 4), device=dev, generator=g, dtype=torch.int32)

def step():
    qp, kp, q, k, v = rnd(B, Hp, S, D), rnd(B, Hpk, S, D), rnd(B, H, S, D), rnd(B, Hk, S, D), rnd(B, Hk, S, D)
    out, kl = F.flash_msa_func(qp, kp, q, k, v, 1024)
    (out.float().sum() + kl).backward()
    out, kl = F.flash_msa_warmup_func(qp, kp, q, k, v, 1024)
    (out.float().sum() + kl).backward()
    out = F.block_sparse_attention(q, k, v, idx, 128)
    out.float().sum().backward()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        out, kl = F.flash_msa_func(qp, kp, q, k, v, 1024)
        (out.float().sum() + kl).backward()
    finally:
        torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()

times = []
for _ in range(2):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
print(json.dumps({"first_step_s": times[0], "second_step_s": times[1],
                  "slices": {unit: seconds for _, unit, seconds in guard.slices_run}}))
"""


def _process(guarded: bool, cache: str) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=cache,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if guarded:
        import torch

        from flash_msa_rt.loader import device_arch

        env.update(FLASH_MSA_GUARD="raise", FLASH_MSA_GUARD_UNVERIFIED=device_arch(torch.cuda.current_device()))
    else:
        env.update(FLASH_MSA_GUARD="off")
    done = subprocess.run([sys.executable, "-c", _STEP], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    if done.returncode:
        raise SystemExit(f"the {'guarded' if guarded else 'unguarded'} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    pairs = []
    for n in range(args.pairs):
        with tempfile.TemporaryDirectory() as cache:  # an empty guard cache per guarded process
            on = _process(True, cache)
        off = _process(False, tempfile.gettempdir())
        pairs.append({"guarded": on, "unguarded": off, "cost_s": on["first_step_s"] - off["first_step_s"]})
        print(f"pair {n}: first step {on['first_step_s']:.3f} s guarded, {off['first_step_s']:.3f} s unguarded -> "
              f"guard {pairs[-1]['cost_s']:.3f} s; slices: "
              + ", ".join(f"{u} {s:.3f}" for u, s in on["slices"].items()))
    cost = statistics.median(p["cost_s"] for p in pairs)
    slices = {u: statistics.median(p["guarded"]["slices"][u] for p in pairs) for u in pairs[0]["guarded"]["slices"]}
    result = {"what": "first-step time a fresh process adds with the guard on (this arch force-marked unverified, "
                      "empty cache) against FLASH_MSA_GUARD=off, median over process pairs; benchmarks/bench_guard.py",
              "commit": commit(), "device": torch.cuda.get_device_name(), "dtype": "bf16",
              "step": "B=1 S=4096 H=16 Hk=4 Hp=4 Hpk=1 D=128: MSA fwd+bwd, warmup fwd+bwd, block-sparse fwd+bwd, "
                      "MSA fwd+bwd under deterministic algorithms",
              "target_s_all_families": TARGET_SECONDS, "guard_cost_s": cost, "slice_seconds_median": slices,
              "target_met": cost <= TARGET_SECONDS, "pairs": pairs}
    print(f"guard first-use cost: {cost:.3f} s (median of {len(pairs)} pairs); target <= {TARGET_SECONDS} s: "
          f"{'met' if cost <= TARGET_SECONDS else 'NOT met'}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
