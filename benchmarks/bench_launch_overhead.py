"""Host cost of launching an artifact kernel through the runtime, against torch and the raw driver call.

Run: FLASH_MSA_ARTIFACT_DIR=artifacts PYTHONPATH=. python3 benchmarks/bench_launch_overhead.py
Target (issue 2): a cached launch costs <= 20 us of host time.
"""

from __future__ import annotations

import torch

from benchmarks.common import host_us_per_call, write_results
from flash_msa_rt import driver, proxy_block_scores
from flash_msa_rt.loader import get_kernel
from flash_msa_rt.ops.block_scores import kernel_config
from flash_msa_rt.ops.device import arch_of
from flash_msa_rt.tuning import block_scores as tuning_scores


def main():
    dev = torch.device("cuda", 0)
    q = torch.randn(1, 128, 1, 128, device=dev).to(torch.bfloat16)
    k = torch.randn(1, 128, 1, 128, device=dev).to(torch.bfloat16)
    out = torch.empty(1, 1, 128, 1, device=dev)
    kernel = get_kernel("block_scores", kernel_config("bf16", 128, 128, tuning_scores.choose(arch_of(dev)).mma), dev)
    args = dict(q_proxy=q, k_proxy=k, scores=out, scale=0.088, group=1)
    kernel(**args)
    torch.cuda.synchronize()

    key = next(iter(kernel._packed))
    packed = kernel._packed[key]
    stream = torch.cuda.current_stream().cuda_stream
    packed.config.hStream = stream

    a = torch.randn(16, 16, device=dev)
    pool = [(torch.randn_like(q), torch.randn_like(k)) for _ in range(300)]  # > the pointer cache: always a miss
    it = iter(range(10**9))

    def fresh_pointers():
        qq, kk = pool[next(it) % len(pool)]
        kernel(q_proxy=qq, k_proxy=kk, scores=out, scale=0.088, group=1)

    outs = [torch.empty_like(out) for _ in range(300)]  # q and k stay: their descriptors are reused

    def fresh_output():
        kernel(q_proxy=q, k_proxy=k, scores=outs[next(it) % len(outs)], scale=0.088, group=1)

    results = {
        "raw cuLaunchKernelEx (prepared params)": host_us_per_call(
            lambda: driver.launch(packed.config, kernel._func, packed.address)),
        "runtime kernel call, cached signature": host_us_per_call(lambda: kernel(**args)),
        "public op proxy_block_scores(out=...), cached": host_us_per_call(
            lambda: proxy_block_scores(q, k, out=out)),
        "public op proxy_block_scores, allocating output": host_us_per_call(lambda: proxy_block_scores(q, k)),
        "runtime kernel call, new pointers (2 TMA encodes)": host_us_per_call(fresh_pointers, calls=600),
        "runtime kernel call, new output pointer (descriptors reused)": host_us_per_call(fresh_output, calls=600),
        "torch.matmul 16x16 (reference point)": host_us_per_call(lambda: a @ a),
    }

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            kernel(**args)
    graph.replay()
    torch.cuda.synchronize()
    results["CUDA graph replay of 100 launches, per launch"] = host_us_per_call(graph.replay, calls=20) / 100

    print(f"{'what':<55} {'host us/call':>12}")
    for name, us in results.items():
        print(f"{name:<55} {us:>12.2f}")
    target = results["runtime kernel call, cached signature"]
    print(f"\ntarget <= 20 us for a cached launch: {target:.2f} us -> {'MET' if target <= 20 else 'MISSED'}")
    path = write_results("launch_overhead", {"host_us_per_call": results, "target_us": 20})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
