#!/usr/bin/env bash
# Nsight Compute on the plan kernels (plan_lists count and scatter, one launch each) of one forward at
# configuration (b), S = 64K, B = 2: speed of light, memory tables, warp stalls and source counters (uncoalesced
# accesses). From the source tree with artifacts/ built for the device's arch:
#   OUT=/tmp/ncu bash benchmarks/ncu_plan.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export FLASH_MSA_ARTIFACT_DIR=${FLASH_MSA_ARTIFACT_DIR:-artifacts} PYTHONPATH=.
out=${OUT:-benchmarks/results}
mkdir -p "$out"
ncu --kernel-name regex:"PlanLists" --launch-count ${NCU_LAUNCHES:-2} \
  --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables --section SourceCounters --section LaunchStats --section Occupancy \
  python3 - <<'PY' > "$out/ncu_plan.log" 2>&1
import os
import torch
from benchmarks.bench_sparse_fwd import random_problem
from flash_msa_rt.ops import sparse_plan
sparse_plan.SCATTER_THREADS = int(os.environ.get("SCATTER_THREADS", sparse_plan.SCATTER_THREADS))
from flash_msa_rt.ops.select import select_blocks_cuda
from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda
x = random_problem("b", 65536, 131072)
sel = select_blocks_cuda(x["qp"], x["kp"], 16, 128, x["scale"])
msa_forward_cuda(x["qp"], x["kp"], x["q"], x["k"], x["v"], sel, 128, x["scale"])
torch.cuda.synchronize()
PY
grep -iE "PlanLists|Duration|Throughput|L1/TEX Hit|L2 Hit|stall|Warp Cycles Per Issued|Eligible|excessive|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Executed Ipc|Issue Slots|Shared Memory Configuration|Bank" "$out/ncu_plan.log" | cut -c1-220 | head -150
