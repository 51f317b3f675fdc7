#!/usr/bin/env bash
# Nsight Compute summary (speed of light, warp stalls, memory) of one launch of every sparse kernel, for
# configuration (b) at S = 16K, B = 2; from the source tree with artifacts/ built for the device's arch:
#   OUT=/tmp/ncu bash benchmarks/ncu_sparse.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export FLASH_MSA_ARTIFACT_DIR=${FLASH_MSA_ARTIFACT_DIR:-artifacts} PYTHONPATH=.
out=${OUT:-benchmarks/results}
mkdir -p "$out"
ncu --kernel-name regex:"kernel_cutlass_kernel_" --launch-count 8 \
  --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats --section ComputeWorkloadAnalysis \
  python3 - <<'PY' > "$out/ncu_sparse.log" 2>&1
import torch
from flash_msa_rt import tuning
from flash_msa_rt.ops.select import select_blocks_cuda
from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda
from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
B, S, H, Hk, Hp, D = 2, 16384, 32, 8, 8, 128
# one chunk: each kernel launches once (select, forward, combine, KL, delta, backward, proxy backward)
tuning.override(sparse_fwd={"partials_budget": 8 << 30}).__enter__()
qp, kp = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16) for h in (Hp, 1))
q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
sel = select_blocks_cuda(qp, kp, 16, 128, D ** -0.5)
o, lse, lsep, kl = msa_forward_cuda(qp, kp, q, k, v, sel, 128, D ** -0.5)
msa_backward_cuda(qp, kp, q, k, v, o, lse, lsep, sel, 128, D ** -0.5, torch.randn_like(q), kl)
torch.cuda.synchronize()
PY
grep -E "kernel_cutlass|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Issue Slots Busy|Executed Ipc A|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|One or More Eligible|No Eligible|Shared Memory Configuration Size|Max Bandwidth|L1/TEX Cache Throughput|L2 Cache Throughput|Mem Busy|Mem Pipes" "$out/ncu_sparse.log" | head -150
