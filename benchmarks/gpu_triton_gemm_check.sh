#!/usr/bin/env bash
# One call on a Hopper GPU machine, from the repo root (issue #50): the Triton GEMMs' GPU tests, then their speed
# against the CUDA kernel on bench_kernels' 42 GEMMs. Under 8 minutes on an H100.
#   bash benchmarks/gpu_triton_gemm_check.sh     # env: TEST_TIMEOUT (180), BENCH_TIMEOUT (270), BENCH_ARGS, SKIP_TESTS
#   SKIP_BENCH=1 bash ...  # the tests alone, without the benchmark's warm-up: safe beside other GPU work (autotuning
#                          # is not), so the timed part can follow later, alone, with SKIP_TESTS=1
# 1. In parallel (compiling dominates; the timings come after): tests/kernels/test_gemm_variants_gpu.py, one process
#    per MEGATRON_INT8_GEMM_TMA_VARIANT (MEGATRON_INT8_GEMM_KERNEL=tma inside the tests), and test_kernels_gpu.py
#    -k gemm with MEGATRON_INT8_GEMM_KERNEL=plain (the Triton pointer kernel, what GPUs without the CUDA kernel run)
#    and with the default (auto), one compile per config (MEGATRON_INT8_GEMM_AUTOTUNE=0, as gpu_kernels_check.sh).
#    Beside them, bench_triton_gemm.py --warmup compiles the benchmark's kernels into Triton's cache.
# 2. Alone on the GPU: benchmarks/bench_triton_gemm.py (tables to $OUT/bench_triton_gemm.md and $OUT/triton_gemm_*.csv).
# Needs no wheel: nothing here imports megatron-core or torchao.
# $OUT gets 7 files (the machine returns 8 at most): tests.log, bench.log, bench_triton_gemm.md, 4 CSVs.
set -o pipefail
export OUT=${OUT:-/tmp/out}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/tests.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/tests.log"
VARIANTS=$(python3 -c "from megatron_int8.dispatch import CHOICES, ENV_GEMM_TMA_VARIANT as V; print(' '.join(CHOICES[V]))")
status=0
if [ -z "$SKIP_TESTS" ]; then
  start=$(date +%s)
  pids=()
  for v in $VARIANTS; do
    expr=$v  # this variant's test ids, not those of another name that contains it ("duo" in "duo8")
    for o in $VARIANTS; do [ "$o" != "$v" ] && [[ "$o" == *"$v"* ]] && expr="$expr and not $o"; done
    timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_gemm_variants_gpu.py \
      -k "$expr" >"$LOGS/variant_$v.log" 2>&1 &
    pids+=($!)
  done
  for kernel in plain auto; do
    MEGATRON_INT8_GEMM_KERNEL=$kernel MEGATRON_INT8_GEMM_AUTOTUNE=0 timeout "${TEST_TIMEOUT:-180}" \
      python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_kernels_gpu.py -k gemm \
      >"$LOGS/test_kernels_gpu_$kernel.log" 2>&1 &
    pids+=($!)
  done
  if [ -z "$SKIP_BENCH" ]; then
    # meanwhile the benchmark's own compiles (and autotuning) fill Triton's cache, so its timed run is shorter
    timeout "${TEST_TIMEOUT:-180}" python3 benchmarks/bench_triton_gemm.py --warmup ${BENCH_ARGS} >"$LOGS/warmup.txt" 2>&1 &
    warm=$!
  fi
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  if [ -z "$SKIP_BENCH" ]; then wait $warm; tail -3 "$LOGS/warmup.txt" | tee -a "$OUT/tests.log"; fi
  for log in "$LOGS"/*.log; do
    echo "== $(basename "$log"): $(grep -E '(passed|failed|error|skipped)' "$log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$log" | head -5
  done | tee -a "$OUT/tests.log"
  echo "[tests $(( $(date +%s) - start )) s]" | tee -a "$OUT/tests.log"
  for log in "$LOGS"/*.log; do echo "===== $(basename "$log")"; tail -60 "$log"; done >>"$OUT/tests.log"
fi
[ -n "$SKIP_BENCH" ] && exit $status
timeout "${BENCH_TIMEOUT:-270}" python3 benchmarks/bench_triton_gemm.py ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log" \
  | grep -v "^|" || status=1
cat "$OUT/bench_triton_gemm.md" 2>/dev/null
exit $status
