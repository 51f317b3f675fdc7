"""The cost of deterministic mode (issue 4, item 6): flash_msa_func forward + backward with the kernels' atomics
backward, and under torch.use_deterministic_algorithms(True), where dispatch runs the deterministic kernels (sm90a:
partial rows summed in a fixed order) or else the bitwise-reproducible reference backward; both in one run, with
the backend that ran, the peak memory of each, and the bitwise check of two deterministic backward passes.
Configurations (a) H=16 Hk=2 Hp=4 Hpk=1, (b) H=32 Hk=8 Hp=8 Hpk=1, (c) H=64 Hk=4 Hp=4 Hpk=1; top_k 2048, bf16,
D = 128; B = 1, or B = tokens // S with --tokens. Under deterministic mode torch also fills every torch.empty with
NaN (torch.utils.deterministic.fill_uninitialized_memory, on by default): that is part of the cost measured.
Usage: python benchmarks/bench_deterministic.py [--configs a,b] [--seqlens 4096,8192] [--tokens 131072]
       [--out results/deterministic.json]"""

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cuda_time_ms  # noqa: E402

CONFIGS = {"a": (16, 2, 4, 1), "b": (32, 8, 8, 1), "c": (64, 4, 4, 1)}  # H, Hk, Hp, Hpk
D, TOP_K = 128, 2048


def fwd_bwd(ins, grads_out, kl_coef):
    import flash_msa_rt

    leaves = [x.detach().requires_grad_() for x in ins]
    out, kl = flash_msa_rt.flash_msa_func(*leaves, TOP_K, D ** -0.5, layout="bshd")
    torch.autograd.backward((out, kl), (grads_out, kl_coef))
    return [x.grad for x in leaves]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="a")
    p.add_argument("--seqlens", default="4096,8192")
    p.add_argument("--tokens", type=int, default=0, help="B = tokens // S (default B = 1)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    rows = []
    for cfg in a.configs.split(","):
        H, HK, HP, HPK = CONFIGS[cfg]
        for S in (int(x) for x in a.seqlens.split(",")):
            B = max(1, a.tokens // S) if a.tokens else 1
            rows.append(measure(cfg, B, S, H, HK, HP, HPK, a.reps))
    if a.out:
        commit = __import__("os").environ.get("FLASH_MSA_COMMIT", "unknown")
        a.out.write_text(json.dumps(dict(benchmark="deterministic mode cost", commit=commit,
                                         device=torch.cuda.get_device_name(), configs={c: CONFIGS[c] for c in
                                                                                       a.configs.split(",")},
                                         top_k=TOP_K, rows=rows), indent=1))


def measure(cfg, B, S, H, HK, HP, HPK, reps):
    from flash_msa_rt.ops import dispatch

    g = torch.Generator(device="cuda").manual_seed(S)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    ins = [rnd(B, S, h, D) for h in (HP, HPK, H, HK, HK)]
    grads_out = rnd(B, S, H * D)  # layout "bshd": out is (B, S, H * D)
    kl_coef = torch.tensor(0.1, device="cuda")
    fast, fast_gb = timed(lambda: fwd_bwd(ins, grads_out, kl_coef), reps)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            impl = dispatch.implementation("msa_backward", torch.device("cuda"), torch.bfloat16, head_dim=D,
                                           proxy_head_dim=D, block_size=128, group=H // HP, kv_group=H // HK,
                                           varlen=False, deterministic=True)
            backend = "reference" if impl is dispatch.reference_impl("msa_backward") else "kernels"
            det, det_gb = timed(lambda: fwd_bwd(ins, grads_out, kl_coef), reps)
            first, second = fwd_bwd(ins, grads_out, kl_coef), fwd_bwd(ins, grads_out, kl_coef)
    finally:
        torch.use_deterministic_algorithms(False)
    bitwise = all(torch.equal(x, y) for x, y in zip(first, second))
    print(f"({cfg}) B={B} S={S:6d}: kernels {fast:9.2f} ms {fast_gb:5.1f} GB, deterministic ({backend}) {det:9.2f} ms "
          f"{det_gb:5.1f} GB ({det / fast:.2f}x), two deterministic backward passes bitwise identical: {bitwise}",
          flush=True)
    return dict(config=cfg, S=S, B=B, kernels_fwd_bwd_ms=fast, deterministic_fwd_bwd_ms=det, cost_x=det / fast,
                deterministic_backend=backend, kernels_peak_gb=fast_gb, deterministic_peak_gb=det_gb,
                deterministic_bitwise_identical=bitwise)


def timed(fn, reps):
    """(ms per call, peak GB allocated during the calls)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = cuda_time_ms(fn, warmup=1, reps=reps)
    return ms, torch.cuda.max_memory_allocated() / 1e9


if __name__ == "__main__":
    main()
