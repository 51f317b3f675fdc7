#!/usr/bin/env bash
# Everything that needs the GPU, from the source tree with artifacts/ built for the device's arch with every build
# set (python -m build_tools build --arch sm90a --set all, on the CPU machine: the GPU tests and sanitizers also
# run the opt-in alternates, through flash_msa_rt.tuning.override). This script builds nothing:
#   FLASH_MSA_COMMIT=<the hash, written out here: git on the GPU machine holds an older HEAD> \
#     bash benchmarks/run_gpu.sh [tests|bench|core|producer|orders|sync256|pending|long|dp64|cp|warmup|all]
# tests: environment, every GPU test, compute-sanitizer on every kernel family and every matrix point (~220 s on
# the H200 before the matrix points were added); bench: the benchmarks;
# core: only the whole-op benchmarks against cuDNN (B * S = 128K tokens, and B = 1 in (a)), which fit one
# 10-minute device call (~160 s); producer: the warp-specialised main backward's checks, on and off (~150 s);
# orders: the backward's item orders, lists cut at query bins against the defaults (not part of all);
# sync256: the mma.sync kernels at D 256 (sm100a's), their matrix test and two sanitizers (not part of all);
# pending: what the tree has built and not fully run on a GPU, in one ~10-minute call: the plan kernels, the
# guard's slices per shape, selection's "wide" schedule at blocks of 64, sync256 (its sanitizers have not run),
# then orders;
# long: bf16 against fp8 selection, at 128K tokens per step and at B = 1 up to 1M tokens; dp64: (b) with a proxy
# head dim of 64 beside 128 (config b64), at the same shapes (not part of all); cp: context parallelism's per-rank
# compute at 1M over 2, 4, 8 simulated ranks (not part of all); warmup: warmup mode's whole op in exact and
# deferred KL mode against cuDNN, and its proxy kernels alone.
# Logs, JUnit XML and JSON go to $OUT (default benchmarks/logs/<UTC time>/, which git ignores; copy the JSON the
# README cites into benchmarks/results/). Each pytest run records the commit and its command, every test id with
# its outcome (-rA in the log, JUnit XML beside it) and prints a summary. FLASH_MSA_REQUIRE_GPU=1: a GPU test that
# cannot run here (no GPU, no artifacts, a device error) fails instead of skipping.
set -uo pipefail
cd "$(dirname "$0")/.."
export FLASH_MSA_ARTIFACT_DIR=${FLASH_MSA_ARTIFACT_DIR:-artifacts} PYTHONPATH=. PYTHONUNBUFFERED=1
export FLASH_MSA_REQUIRE_GPU=1
out=${OUT:-benchmarks/logs/$(date -u +%Y%m%dT%H%M%SZ)}
mode=${1:-all}
mkdir -p "$out"
status=0
commit=${FLASH_MSA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

# gpu_pytest NAME ARGS...: python -m pytest ARGS with every test id's outcome in $out/NAME.log (-rA) and
# $out/NAME.xml (JUnit), then a summary (counts, and every test that did not pass) on stdout and in
# $out/NAME_summary.txt, headed by the commit and the command.
gpu_pytest() {
  local name=$1
  shift
  local cmd=(python3 -m pytest -m gpu -rA -p no:cacheprovider --junitxml="$out/$name.xml"
             -o junit_suite_name="flash-msa GPU tests at $commit" "$@")
  local rc
  {
    echo "commit: $commit (FLASH_MSA_COMMIT=${FLASH_MSA_COMMIT:-unset}; git HEAD here: $(git rev-parse HEAD 2>/dev/null || echo none))"
    echo "command: FLASH_MSA_REQUIRE_GPU=$FLASH_MSA_REQUIRE_GPU FLASH_MSA_ARTIFACT_DIR=$FLASH_MSA_ARTIFACT_DIR ${cmd[*]}"
    echo "started: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  } | tee "$out/${name}_summary.txt" > "$out/$name.log"
  "${cmd[@]}" >> "$out/$name.log" 2>&1
  rc=$?
  python3 - "$out/$name.xml" "$rc" <<'PY' | tee -a "$out/${name}_summary.txt"
import sys
import xml.etree.ElementTree as ET

path, rc = sys.argv[1], int(sys.argv[2])
try:
    cases = list(ET.parse(path).getroot().iter("testcase"))
except (OSError, ET.ParseError) as e:
    print(f"no JUnit XML ({e}); pytest exit status {rc}")
    sys.exit(0)
counts, rest = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}, []
for case in cases:
    tid = f"{case.get('classname', '')}::{case.get('name', '')}"
    bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(bad.tag if bad is not None else "", "passed")
    counts[outcome] += 1
    if bad is not None:
        rest.append(f"  {outcome.upper()} {tid}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}")
print(f"{len(cases)} test ids: " + ", ".join(f"{n} {k}" for k, n in counts.items()) + f"; pytest exit status {rc}")
print("\n".join(rest))
PY
  return $rc
}

if [[ $mode == tests || $mode == all ]]; then
  { nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; python3 -m flash_msa_rt info; } \
    2>&1 | tee "$out/env.log"
  gpu_pytest gpu_tests tests || status=1

  # Out-of-bounds accesses, races and uninitialised reads show here before they show as flaky numbers.
  # API errors are not reported: cuda-python probes the driver for entry points newer than it has (harmless
  # CUDA_ERROR_INVALID_VALUE from cuGetProcAddress), which would drown the kernel's own report.
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck synccheck initcheck; do
      timeout 200 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 python3 -c "
import torch, flash_msa_rt
from flash_msa_rt.loader import device_arch
from flash_msa_rt import tuning
from flash_msa_rt.ops.select import select_blocks_cuda
from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda
from flash_msa_rt.ops.sparse_bwd import msa_backward_cuda
q = torch.randn(2, 333, 2, 128, device='cuda').to(torch.bfloat16)
flash_msa_rt.proxy_block_scores(q, q[:, :, :1])
select_blocks_cuda(q, q[:, :, :1], 20, 128, 0.1)
if device_arch(0) == 'sm90a':  # fp8 selection (e4m3 variants, wgmma), 64 and 16 slots
    for schedule in ('block', 'pairs'):  # pairs: two key blocks per loop step (opt-in build)
        with tuning.override(select={'schedule': schedule}):
            select_blocks_cuda(q, q[:, :, :1], 20, 128, 0.1, 'fp8')
            select_blocks_cuda(q, q[:, :, :1], 3, 128, 0.1, 'fp8')
    from flash_msa_rt.ops.fp8_quant import quantize_cuda  # its quantisation kernels alone: f16, Dp 64, bhsd view
    for x in (q.half(), torch.randn(2, 3, 333, 64, device='cuda').half().transpose(1, 2)):
        quantize_cuda(x, 1), quantize_cuda(x, 128)
for mma in ['sync', 'wgmma'] if device_arch(0) == 'sm90a' else ['sync']:  # keys longer than queries: a chunk
    with tuning.override(**tuning.every_mma(mma)):  # at key offset 77 (inside a block) and 128 + 200
        select_blocks_cuda(q[:, 77:], q[:, :, :1], 20, 128, 0.1)
        select_blocks_cuda(q[:, 328:], q[:, :, :1], 3, 128, 0.1)
if device_arch(0) == 'sm90a':
    select_blocks_cuda(q[:, 77:], q[:, :, :1], 20, 128, 0.1, 'fp8')
sel = select_blocks_cuda(q, q[:, :, :1], 3, 128, 0.1)
from flash_msa_rt.ops.sparse_plan import chunk_plans  # the plan kernels at K = 20 (64 slots) and 3 (16 slots)
chunk_plans(select_blocks_cuda(q, q[:, :, :1], 20, 128, 0.1), 128, 4, 1, 128, ((32, 64), (64, 32)), 'size')
m = torch.randn(2, 333, 8, 128, device='cuda').to(torch.bfloat16)
kv = torch.randn(2, 333, 2, 128, device='cuda').to(torch.bfloat16)
for mma in ['sync', 'wgmma'] if device_arch(0) == 'sm90a' else ['sync']:  # every kernel kind sm90a builds
    with tuning.override(**tuning.every_mma(mma)):
        select_blocks_cuda(q, q[:, :, :1], 20, 128, 0.1)
        select_blocks_cuda(q, q[:, :, :1], 3, 128, 0.1)
        o, lse, lsep, kl = msa_forward_cuda(q, q[:, :, :1], m, kv, kv, sel, 128, 0.1)
        msa_backward_cuda(q, q[:, :, :1], m, kv, kv, o, lse, lsep, sel, 128, 0.1, torch.randn_like(m), kl)
        sel_c = select_blocks_cuda(q[:, 77:], q[:, :, :1], 3, 128, 0.1)  # a chunk: keys longer than queries (77)
        o, lse, lsep, kl = msa_forward_cuda(q[:, 77:], q[:, :, :1], m[:, 77:], kv, kv, sel_c, 128, 0.1)
        msa_backward_cuda(q[:, 77:], q[:, :, :1], m[:, 77:], kv, kv, o, lse, lsep, sel_c, 128, 0.1, torch.randn_like(o),
                          kl)
if device_arch(0) == 'sm90a':  # G = 16: the KL pass's streamed ping-pong (its heads through a ring), tau export;
    # the deterministic backward kernels (partial rows stored) at G = 16 and G = 4
    m16 = torch.randn(2, 333, 32, 128, device='cuda').to(torch.bfloat16)
    o, lse, lsep, kl = msa_forward_cuda(q, q[:, :, :1], m16, kv, kv, sel, 128, 0.1)
    msa_backward_cuda(q, q[:, :, :1], m16, kv, kv, o, lse, lsep, sel, 128, 0.1, torch.randn_like(m16), kl)
    # initcheck does not see the deterministic kernels' bulk (async-proxy) stores of their dq rows, so those rows
    # come NaN-filled, as under torch.use_deterministic_algorithms; the GPU tests check that none survives.
    torch.use_deterministic_algorithms(True)
    msa_backward_cuda(q, q[:, :, :1], m16, kv, kv, o, lse, lsep, sel, 128, 0.1, torch.randn_like(m16), kl, True)
    o, lse, lsep, kl = msa_forward_cuda(q, q[:, :, :1], m, kv, kv, sel, 128, 0.1)  # deterministic at G = 4
    msa_backward_cuda(q, q[:, :, :1], m, kv, kv, o, lse, lsep, sel, 128, 0.1, torch.randn_like(m), kl, True)
    o, lse, lsep, kl = msa_forward_cuda(q[:, 77:], q[:, :, :1], m[:, 77:], kv, kv, sel_c, 128, 0.1)  # the chunk
    msa_backward_cuda(q[:, 77:], q[:, :, :1], m[:, 77:], kv, kv, o, lse, lsep, sel_c, 128, 0.1, torch.randn_like(o), kl,
                      True, kl_rows=[])
    torch.use_deterministic_algorithms(False)
    # deferred KL mode: the proxy lse alone (sparse_kl kl_value 0), and the tau proxy backward forming the KL value
    from flash_msa_rt.ops.sparse_fwd import msa_kl_cuda
    msa_kl_cuda(q[:, 77:], q[:, :, :1], m[:, 77:], kv, lse, sel_c, 128, 0.1, with_kl=False)  # the chunk's lse
    o, lse, lsep, kl = msa_forward_cuda(q, q[:, :, :1], m, kv, kv, sel, 128, 0.1)
    msa_kl_cuda(q, q[:, :, :1], m, kv, lse, sel, 128, 0.1, with_kl=False)
    msa_backward_cuda(q, q[:, :, :1], m, kv, kv, o, lse, lsep, sel, 128, 0.1, torch.randn_like(m), kl, kl_rows=[])
if device_arch(0) == 'sm90a':  # the other wgmma builds (opt-in set): ping-pong with two q buffers, lockstep
    # warpgroups, the proxy backward's heads stepped and resident
    with tuning.override(sparse_fwd={'stages': 2}):
        msa_forward_cuda(q, q[:, :, :1], m, kv, kv, sel, 128, 0.1)
    with tuning.override(sparse_fwd={'schedule': 'lockstep', 'kl_schedule': 'lockstep'}):
        o, lse, lsep, kl = msa_forward_cuda(q, q[:, :, :1], m, kv, kv, sel, 128, 0.1)
    for heads in ('stepped', 'resident'):  # tau recomputed (the default reads it from the main backward)
        with tuning.override(sparse_bwd={'tau_path': False, 'recompute_heads': heads}):
            msa_backward_cuda(q, q[:, :, :1], m, kv, kv, o, lse, lsep, sel, 128, 0.1, torch.randn_like(m), kl)
if device_arch(0) == 'sm90a':  # the dense warmup proxy kernels: G = 4 and G = 1, the KL pass in both schedules,
    # the proxy lse alone and the proxy backward with the KL value (deferred mode)
    from flash_msa_rt.ops.warmup_kl import warmup_kl_cuda, warmup_lse_cuda, warmup_proxy_backward_cuda
    for schedule in tuning.warmup.KL_SCHEDULE_THREADS:
        with tuning.override(warmup={'kl_schedule': schedule}):
            for mh, ml in ((m, lse), (m[:, :, :2], lse[:, :2])):
                lp, _ = warmup_kl_cuda(q, q[:, :, :1], mh, kv, ml, 0.1)
                warmup_proxy_backward_cuda(q, q[:, :, :1], mh, kv, ml, lp, 0.1, torch.rand(2, 2, 333, device='cuda'))
    lp = warmup_lse_cuda(q, q[:, :, :1], 0.1)
    for mh, ml in ((m, lse), (m[:, :, :2], lse[:, :2])):
        warmup_proxy_backward_cuda(q, q[:, :, :1], mh, kv, ml, lp, 0.1, torch.rand(2, 2, 333, device='cuda'),
                                   torch.empty(2, 2, 333, device='cuda'))
from flash_msa_rt import block_sparse_attention  # widened (Hi < Hk) and crossing (lcm) index heads, repeats
for h, hk, hi in ((8, 2, 2), (12, 4, 3), (16, 4, 1)):
    bq = torch.randn(2, 333, h, 128, device='cuda').to(torch.bfloat16).requires_grad_()
    bk = torch.randn(2, 333, hk, 128, device='cuda').to(torch.bfloat16).requires_grad_()
    bi = torch.randint(-1, 3, (2, hi, 333, 4), device='cuda', dtype=torch.int32)
    block_sparse_attention(bq, bk, bk, bi, 128, layout='bshd').sum().backward()
from flash_msa_rt.ops import kernels  # Dp = 64: its own selection variants (bf16 on the runtime's MMA, fp8), then
# a forward + backward through the kernel backend, which pads the proxy to D = 128 for the KL pass and backward
q64 = q[..., :64].contiguous()
select_blocks_cuda(q64, q64[:, :, :1], 20, 128, 0.1)
if device_arch(0) == 'sm90a':
    select_blocks_cuda(q64, q64[:, :, :1], 20, 128, 0.1, 'fp8')
sel64 = select_blocks_cuda(q64, q64[:, :, :1], 3, 128, 0.1)
o, lse, lsep, kl = kernels._msa_forward(q64, q64[:, :, :1], m, kv, kv, sel64, 128, 0.1)
kernels._msa_backward(q64, q64[:, :, :1], m, kv, kv, o, lse, lsep, sel64, 128, 0.1, torch.randn_like(m), kl)
from flash_msa_rt.ops.grad_cast import cast_into  # the gradient cast: a head slice (bf16, D 128), a bhsd view (f16)
g16 = torch.empty(2, 333, 6, 128, device='cuda', dtype=torch.bfloat16)
cast_into(torch.randn(2, 333, 3, 128, device='cuda'), g16[:, :, 2:5])
g16 = torch.empty(2, 3, 333, 64, device='cuda', dtype=torch.half)
cast_into(torch.randn(2, 333, 3, 64, device='cuda'), g16.transpose(1, 2))
torch.cuda.synchronize()
" 2>&1 | tail -3 | sed "s/^/[$tool] /" | tee -a "$out/sanitizer.log" || status=1
      # the plan kernels at sizes the line above does not reach: two bitmap windows, 512-row scatter CTAs
      timeout 200 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 \
        python3 benchmarks/sanitize_plan.py 2>&1 | tail -2 | sed "s/^/[$tool plan] /" | tee -a "$out/sanitizer.log" \
        || status=1
      # every other (D, Dp, Bs) point of the matrix, attention sinks included (cuDNN's own kernels excluded by
      # name, initcheck without warmup: benchmarks/sanitize_matrix.py says why)
      extra=(); [[ $tool == initcheck ]] && extra=(--no-warmup)
      timeout 200 compute-sanitizer --tool "$tool" --report-api-errors no --kernel-name-exclude kns=cudnn \
        --error-exitcode 9 python3 benchmarks/sanitize_matrix.py "${extra[@]}" 2>&1 | tail -2 \
        | sed "s/^/[$tool matrix] /" | tee -a "$out/sanitizer.log" || status=1
      # sm100a's mma.sync kernels at D 256 (dQ and O in column pieces), from the hopper_sync_check set
      timeout 200 compute-sanitizer --tool "$tool" --report-api-errors no --kernel-name-exclude kns=cudnn \
        --error-exitcode 9 python3 benchmarks/sanitize_matrix.py --mma sync --points 256:128:64,256:128:128 2>&1 \
        | tail -2 | sed "s/^/[$tool sync D 256] /" | tee -a "$out/sanitizer.log" || status=1
    done
  fi
fi

if [[ $mode == producer ]]; then
  # The warp-specialised main backward (tuning.sparse_bwd's producer; off: an opt-in build variant): its GPU tests
  # (on and off at G = 1, 2, 4) and the four sanitizers on it.
  gpu_pytest gpu_tests_producer tests/test_sparse_bwd_gpu.py || status=1
  for tool in racecheck synccheck memcheck initcheck; do
    timeout 200 compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 \
      python3 benchmarks/sanitize_bwd.py 2>&1 | grep -v "^=========     at " | awk 'NR <= 20' | sed "s/^/[$tool] /" \
      | tee -a "$out/sanitizer_producer.log" || status=1
  done
fi

if [[ $mode == pending ]]; then
  # The plan_lists kernels at key blocks of 64 and 128: their plans against the torch sort; the first-use guard's
  # slices at every shape the artifacts carry.
  gpu_pytest gpu_tests_plans tests/test_sparse_plan_gpu.py tests/test_guard_gpu.py || status=1
  # Selection at key blocks of 64 in 128-key steps (schedule "wide", opt-in: artifacts built with --set all
  # --block-size 64): bit for bit the one-block loop's selection, then both timed at top_k 2048 (K = 32).
  gpu_pytest gpu_tests_select_wide tests/test_select_gpu.py -k wide_schedule || status=1
  python3 benchmarks/bench_select.py --block-size 64 --schedules block,wide --proxy-dims 64,128 --k-values 32 \
    --lengths 16384,65536,131072 2>&1 | tee "$out/bench_select_b64.log" || status=1
fi

if [[ $mode == sync256 || $mode == pending ]]; then
  # sm100a's mma.sync kernels at D 256 (dQ, dq_p and O in column pieces), from the hopper_sync_check set: the
  # matrix tests against the reference (MSA at G 4, 8, 16; block-sparse), then memcheck and racecheck over the
  # public API.
  gpu_pytest gpu_tests_sync256 tests/test_matrix_gpu.py -k "(sm100a_runs and D256) or (block_sparse and sync)" \
    || status=1
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool "$tool" --report-api-errors no --kernel-name-exclude kns=cudnn \
      --error-exitcode 9 python3 benchmarks/sanitize_matrix.py --mma sync --points 256:128:64,256:128:128 2>&1 \
      | tail -2 | sed "s/^/[$tool sync D 256] /" | tee -a "$out/sanitizer_sync256.log" || status=1
  done
fi

if [[ $mode == orders || $mode == pending ]]; then
  # The backward's item orders (issue 55; kernels_src/sparse_bwd/NOTES.md, "Lists cut at query bins"): every order
  # against the reference, then the whole graphed deferred-KL step at key blocks of 64 (where "bins" is the
  # backward's default; it lost at blocks of 128 and at D 256, sweep_bins.json) with bins of 8192 and 2048
  # queries against the default 4096, the forward's lists cut at bins too, and the forward's partials in 8 GiB
  # chunks (twice the partials of blocks of 128 cut into twice the chunks), at (b) and (a) (B = 1, 64K).
  gpu_pytest gpu_tests_orders tests/test_sparse_bwd_gpu.py -k every_item_order || status=1
  python3 benchmarks/sweep_small.py b:65536:1:128:64 a:65536:1:128:64 --rounds 3 --reps 4 \
    --settings '[{"sparse_bwd": {"bin_queries": 8192}}, {"sparse_bwd": {"bin_queries": 2048}},
                 {"sparse_fwd": {"item_order": "bins"}}, {"sparse_fwd": {"partials_budget": 8589934592}}]' \
    --out "$out/sweep_orders.json" 2>&1 | tee "$out/sweep_orders.log" || status=1
fi

if [[ $mode == core ]]; then
  python3 benchmarks/bench_msa.py --configs a,b,c --seqlens 8192,16384,32768,65536,131072 --ops sparse,dense \
    --skewed --out "$out/msa.json" 2>&1 | tee "$out/bench_msa.log" || status=1
  python3 benchmarks/bench_msa.py --configs a --seqlens 8192,16384,32768,65536 --ops sparse,dense --batch1 \
    --out "$out/msa_batch1.json" 2>&1 | tee "$out/bench_msa_batch1.log" || status=1
fi

if [[ $mode == long ]]; then
  # Selection precision (issue 10): bf16 and fp8 selection and the whole op at 128K tokens per step in (a) and (b),
  # then (b) at B = 1 from 256K to 1M tokens (deferred KL; dense attention is not run there: ~58 s a call at 1M).
  python3 benchmarks/bench_msa.py --configs a,b --seqlens 8192,16384,32768,65536,131072 --ops sparse,dense \
    --select-precisions bf16,fp8 --kl-values deferred --out "$out/msa_fp8.json" 2>&1 | tee "$out/bench_msa_fp8.log"
  python3 benchmarks/bench_msa.py --configs b --batch1 --seqlens 262144,524288,1048576 --ops sparse \
    --select-precisions bf16,fp8 --kl-values deferred --warmup 1 --reps 3 --out "$out/msa_long.json" 2>&1 \
    | tee "$out/bench_msa_long.log"
  # fp8 selection's quantisation: the fp8_quant kernels against the torch ops, and their share of the selection
  python3 benchmarks/bench_fp8_quant.py --out "$out/fp8_quant.json" 2>&1 | tee "$out/bench_fp8_quant.log"
fi

if [[ $mode == cp ]]; then
  # Context parallelism's per-rank compute at 1M tokens (issue 37): N = 2, 4, 8 simulated zigzag ranks on one GPU
  # through the separate-key path on the kernels (each chunk unpadded), beside the whole op; fp8 selection.
  python3 benchmarks/bench_cp_rank.py --out "$out/cp_rank.json" 2>&1 | tee "$out/bench_cp_rank.log" || status=1
fi

if [[ $mode == dp64 ]]; then
  # A smaller proxy (issue 36): (b) at Dp = 64 (b64) beside Dp = 128, bf16 and fp8 selection, the whole op with the
  # deferred KL; 128K tokens per step at 64K and 128K, then B = 1 from 256K to 1M tokens.
  python3 benchmarks/bench_msa.py --configs b,b64 --seqlens 65536,131072 --ops sparse \
    --select-precisions bf16,fp8 --kl-values deferred --out "$out/msa_dp64.json" 2>&1 | tee "$out/bench_msa_dp64.log"
  python3 benchmarks/bench_msa.py --configs b,b64 --batch1 --seqlens 262144,524288,1048576 --ops sparse \
    --select-precisions bf16,fp8 --kl-values deferred --warmup 1 --reps 3 --out "$out/msa_dp64_long.json" 2>&1 \
    | tee "$out/bench_msa_dp64_long.log"
fi

if [[ $mode == warmup ]]; then
  # Warmup mode alone (issue 35, item 4): the whole op in exact and deferred KL mode against cuDNN, and its proxy
  # kernels (the KL pass, the proxy lse alone, the proxy backward with and without the KL value).
  python3 benchmarks/bench_warmup_kl.py --configs a,b,c --seqlens 8192,65536 --no-sparse --out warmup_kl \
    2>&1 | tee "$out/bench_warmup_kl.log" || status=1
  python3 benchmarks/bench_msa.py --configs a,b,c --seqlens 8192,16384,32768,65536 --ops warmup,dense \
    --kl-values exact,deferred --warmup 1 --reps 5 --out "$out/warmup.json" 2>&1 | tee "$out/bench_warmup.log" \
    || status=1
fi

if [[ $mode == bench || $mode == all ]]; then
  python3 benchmarks/bench_launch_overhead.py 2>&1 | tee "$out/bench_launch.log"
  # The whole op (select + forward + backward) against cuDNN dense attention, B*S = 128K tokens, and at B = 1
  # for configuration (a) beside flash-msa 0.1.1's published B = 1 figures.
  python3 benchmarks/bench_msa.py --configs a,b,c --seqlens 8192,16384,32768,65536,131072 --ops sparse,dense \
    --skewed --out "$out/msa.json" 2>&1 | tee "$out/bench_msa.log"
  # Warmup mode (issue 5): cuDNN's dense main attention + the proxy's KL pass and backward kernels over every
  # causal block, against cuDNN dense attention alone.
  python3 benchmarks/bench_msa.py --configs a,b,c --seqlens 8192,16384,32768,65536 --ops warmup,dense \
    --kl-values exact,deferred --warmup 1 --reps 5 --out "$out/warmup.json" 2>&1 | tee "$out/bench_warmup.log"
  # Warmup's proxy kernels alone: the dense KL pass and proxy backward against the sparse kernels over the
  # all-causal selection and cuDNN's forward and backward.
  python3 benchmarks/bench_warmup_kl.py --configs a,b,c --seqlens 8192,65536 2>&1 | tee "$out/bench_warmup_kl.log"
  python3 benchmarks/bench_deterministic.py --seqlens 4096,8192 --out "$out/deterministic.json" 2>&1 \
    | tee "$out/bench_deterministic.log"
  python3 benchmarks/bench_msa.py --configs a --seqlens 8192,16384,32768,65536 --ops sparse,dense --batch1 \
    --out "$out/msa_batch1.json" 2>&1 | tee "$out/bench_msa_batch1.log"
  python3 benchmarks/bench_sparse_fwd.py --configs a,b,c --seqlens 65536 --out "$out/sparse_stages.json" 2>&1 \
    | tee "$out/bench_sparse_stages.log"
  python3 benchmarks/profile_msa.py b 65536 --out "$out/profile_msa.json" 2>&1 | tee "$out/profile_msa.log"
  # block_sparse_attention against cuDNN dense and FSA's published figures.
  python3 benchmarks/bench_block_sparse.py 2>&1 | tee "$out/bench_block_sparse.log"
fi
exit $status
