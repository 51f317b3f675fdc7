#!/usr/bin/env bash
# Everything that needs the GPU, in one go (one device call): environment, GPU tests, a memory check,
# benchmarks. Run from the source tree with artifacts/ built for the device's arch:
#   FLASH_MSA_COMMIT=$(git rev-parse HEAD) bash benchmarks/run_gpu.sh
# Logs and JSON go to $OUT (or benchmarks/results/ when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
export FLASH_MSA_ARTIFACT_DIR=${FLASH_MSA_ARTIFACT_DIR:-artifacts} PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
status=0

{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; python3 -m flash_msa_rt info; } \
  2>&1 | tee "$out/env.log"
python3 -m pytest -m gpu -v -p no:cacheprovider tests 2>&1 | tee "$out/gpu_tests.log" || status=1

# Out-of-bounds accesses, races and uninitialised reads show here before they show as flaky numbers.
# API errors are not reported: cuda-python probes the driver for entry points newer than it has (harmless
# CUDA_ERROR_INVALID_VALUE from cuGetProcAddress), which would drown the kernel's own report.
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck synccheck initcheck; do
    timeout 120 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 python3 -c "
import torch, flash_msa_rt
from flash_msa_rt.ops.select import select_blocks_cuda
q = torch.randn(2, 333, 2, 128, device='cuda').to(torch.bfloat16)
flash_msa_rt.proxy_block_scores(q, q[:, :, :1])
select_blocks_cuda(q, q[:, :, :1], 3, 128, 0.1)
select_blocks_cuda(q, q[:, :, :1], 20, 128, 0.1); torch.cuda.synchronize()
" 2>&1 | tail -3 | sed "s/^/[$tool] /" | tee -a "$out/sanitizer.log" || status=1
  done
fi

python3 benchmarks/bench_launch_overhead.py 2>&1 | tee "$out/bench_launch.log"
python3 benchmarks/bench_block_scores.py 2>&1 | tee "$out/bench_block_scores.log"
python3 benchmarks/bench_select.py 2>&1 | tee "$out/bench_select.log"
exit $status
