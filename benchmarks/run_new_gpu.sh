#!/usr/bin/env bash
# One GPU call: the offline wheels (transformers for the M3 tests), then pytest over the files named (first), then
# with --rest the remaining GPU tests; every failing test id in $OUT/NAME.log.
# Usage: bash benchmarks/run_new_gpu.sh NAME [--rest] test-files...
set -uo pipefail
name=$1; shift
rest=0; [ "${1:-}" = "--rest" ] && { rest=1; shift; }
out=${OUT:-/tmp}
if [ -d wheels ]; then
  python3 -m pip install -q --no-index --no-deps --find-links wheels $(cat wheels/NAMES) >"$out/pip.log" 2>&1 \
    || echo "wheel install failed (see pip.log)"
fi
export FLASH_MSA_ARTIFACT_DIR=${FLASH_MSA_ARTIFACT_DIR:-artifacts_gpu} FLASH_MSA_REQUIRE_GPU=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -m pytest -m gpu -q -rfE -p no:cacheprovider "$@" 2>&1 | tee "$out/$name.log" | tail -40
if [ $rest = 1 ]; then
  ignores=(); for f in "$@"; do ignores+=(--ignore "$f"); done
  python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests "${ignores[@]}" 2>&1 | tee "$out/${name}_rest.log" | tail -40
fi
