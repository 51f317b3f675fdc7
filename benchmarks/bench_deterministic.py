"""The cost of deterministic mode (issue 4, item 6): flash_msa_func forward + backward with the kernels' atomics
backward, and under torch.use_deterministic_algorithms(True), where dispatch runs the bitwise-reproducible
reference backward instead; both in one run, with the bitwise check of two deterministic backward passes.
Configuration (a) (H=16, Hk=2, Hp=4, Hpk=1), B = 1, top_k 2048, bf16, D = 128.
Usage: python benchmarks/bench_deterministic.py [--seqlens 4096,8192] [--out results/deterministic.json]"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cuda_time_ms  # noqa: E402

H, HK, HP, HPK, D, TOP_K = 16, 2, 4, 1, 128, 2048


def fwd_bwd(ins, grads_out, kl_coef):
    import flash_msa_rt

    leaves = [x.detach().requires_grad_() for x in ins]
    out, kl = flash_msa_rt.flash_msa_func(*leaves, TOP_K, D ** -0.5, layout="bshd")
    torch.autograd.backward((out, kl), (grads_out, kl_coef))
    return [x.grad for x in leaves]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", default="4096,8192")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    rows = []
    for S in (int(x) for x in a.seqlens.split(",")):
        g = torch.Generator(device="cuda").manual_seed(S)
        rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
        ins = [rnd(1, S, h, D) for h in (HP, HPK, H, HK, HK)]
        grads_out = rnd(1, S, H * D)  # layout "bshd": out is (B, S, H * D)
        kl_coef = torch.tensor(0.1, device="cuda")
        fast = cuda_time_ms(lambda: fwd_bwd(ins, grads_out, kl_coef), warmup=2, reps=a.reps)
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                det = cuda_time_ms(lambda: fwd_bwd(ins, grads_out, kl_coef), warmup=1, reps=a.reps)
                first, second = fwd_bwd(ins, grads_out, kl_coef), fwd_bwd(ins, grads_out, kl_coef)
        finally:
            torch.use_deterministic_algorithms(False)
        bitwise = all(torch.equal(x, y) for x, y in zip(first, second))
        row = dict(S=S, B=1, kernels_fwd_bwd_ms=fast, deterministic_fwd_bwd_ms=det, cost_x=det / fast,
                   deterministic_bitwise_identical=bitwise)
        rows.append(row)
        print(f"S={S:6d}: kernels {fast:9.2f} ms, deterministic {det:9.2f} ms ({det / fast:.1f}x), "
              f"two deterministic backward passes bitwise identical: {bitwise}", flush=True)
    if a.out:
        commit = __import__("os").environ.get("FLASH_MSA_COMMIT", "unknown")
        a.out.write_text(json.dumps(dict(benchmark="deterministic mode cost", commit=commit,
                                         device=torch.cuda.get_device_name(), config="(a) H=16 Hk=2 Hp=4 Hpk=1",
                                         top_k=TOP_K, rows=rows), indent=1))


if __name__ == "__main__":
    main()
