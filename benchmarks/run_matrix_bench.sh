#!/usr/bin/env bash
# One GPU call of benchmarks (issues 53, 52, 54): configuration (b), deferred KL, 128K tokens per step, at each
# (D, Bs) of the matrix against cuDNN dense at the same D; then the compile modes at (a) B = 1; then the M3 block.
# Each run is bounded so that the call fits the device's 10-minute limit; JSON and logs land in $OUT.
set -uo pipefail
out=${OUT:-/tmp}
export FLASH_MSA_ARTIFACT_DIR=${FLASH_MSA_ARTIFACT_DIR:-artifacts_gpu} PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for c in ${MATRIX:-128:128 64:128 64:64 128:64}; do
  d=${c%:*}; b=${c#*:}
  timeout ${PER_CONFIG_S:-100} python3 benchmarks/bench_msa.py --configs b --kl-values deferred --seqlens ${SEQLENS:-65536,131072} \
    --ops sparse,dense --head-dim $d --block-size $b --warmup 2 --reps 5 --tag matrix_d${d}_b${b} > "$out/bench_d${d}_b${b}.log" 2>&1
  echo "d$d b$b rc=$?"; sed -n '/^speedup over/,/^backends/p' "$out/bench_d${d}_b${b}.log" | head -12
done
if [ "${COMPILE:-1}" = 1 ]; then
  timeout ${COMPILE_S:-150} python3 benchmarks/bench_compile.py --seqlens 8192,16384,32768 --steps 10 > "$out/bench_compile.log" 2>&1
  echo "compile rc=$?"; tail -18 "$out/bench_compile.log"
fi
if [ "${M3:-1}" = 1 ] && [ -d wheels ]; then
  python3 -m pip install -q --no-index --no-deps --find-links wheels $(cat wheels/NAMES) > "$out/pip.log" 2>&1
  timeout ${M3_S:-150} python3 benchmarks/bench_transformers_m3.py --seqlens 16384,65536,131072 --reps 2 > "$out/bench_m3.log" 2>&1
  echo "m3 rc=$?"; tail -15 "$out/bench_m3.log"
fi
# every result in one file (a call brings back a limited number of files)
(cd benchmarks/results && tar czf "$out/results.tgz" $(ls -t msa_matrix_*.json transformers_m3.json compile.json 2>/dev/null))
