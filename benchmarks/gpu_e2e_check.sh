#!/usr/bin/env bash
# One device call on a several-GPU host (nvidia-h200-x4; repo root, .whl with megatron-core carried):
# the six models' end-to-end INT8 vs BF16 throughput (benchmarks/bench_e2e.py, one model per GPU at a time on
# E2E_GPUS) while the kernel and layer GPU tests run on TEST_GPU. Tables and logs go to $OUT.
#
#   bash benchmarks/gpu_e2e_check.sh
#
# Environment: E2E_GPUS [0 1 2], TEST_GPU [3] (empty: no tests), TESTS [kernels layers] (which of
# tests/{kernels,megatron,training}/test_{kernels,layers,training}_gpu.py run there, in that order), MODELS (bench_e2e.py's order: the
# largest first, so the last round holds the quick ones), ITERS [10], WARMUP [3], MICRO_BATCH [1],
# GRAD_ACCUM [8] (micro-batches per step), E2E_TIMEOUT [540], TEST_TIMEOUT [420] (per test file),
# DEADLINE [570] (seconds since the script started by which every test file has ended), EXTRA (more
# trainer flags for every run).
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# autotuning results shared through Triton's cache by the runs that follow the first of each shape
export TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'mcore', m.__version__)" | tee -a "$OUT/gpu.txt"

if [[ -n "${TEST_GPU-3}" ]]; then
  (
    export CUDA_VISIBLE_DEVICES=${TEST_GPU-3}
    for t in ${TESTS:-kernels layers}; do
      # fixed GEMM tiles (TMA where eligible) for the bulk of the kernel tests (the autotuned-path tests turn tuning on)
      [[ $t == kernels ]] && autotune=0 || autotune=
      # each file ends before DEADLINE: a test cut off by the device call's own limit would keep the GPU busy
      left=$(( ${DEADLINE:-570} - SECONDS ))
      (( left < 30 )) && { echo "not run: ${left} s left of DEADLINE" > "$OUT/${t}_tests.log"; continue; }
      limit=$(( left < ${TEST_TIMEOUT:-420} ? left : ${TEST_TIMEOUT:-420} ))
      MEGATRON_INT8_GEMM_AUTOTUNE=$autotune timeout -k 5 "$limit" python3 -m pytest -q -p no:cacheprovider \
        -rf --durations=5 "$(ls tests/*/test_${t}_gpu.py)" > "$OUT/${t}_tests.log" 2>&1
      echo "exit $?" >> "$OUT/${t}_tests.log"
    done
  ) &
  tests=$!
fi

MODELS=${MODELS:-"llama2_13b mixtral_8x7b_8l qwen3_8b llama3.1_8b llama2_7b qwen3_4b"}
timeout "${E2E_TIMEOUT:-540}" python3 benchmarks/bench_e2e.py --gpus ${E2E_GPUS:-0 1 2} --models $MODELS \
  --iters "${ITERS:-10}" --warmup "${WARMUP:-3}" --micro-batch-size "${MICRO_BATCH:-1}" --grad-accum "${GRAD_ACCUM:-8}" \
  --out "$OUT/bench_e2e.md" ${EXTRA:+--extra $EXTRA} 2>&1 \
  | tee "$OUT/bench_e2e.log"
status=${PIPESTATUS[0]}
if [[ -n "${tests:-}" ]]; then
  wait "$tests"
  for t in ${TESTS:-kernels layers}; do tail -n 4 "$OUT/${t}_tests.log"; done
fi
cat "$OUT/bench_e2e.md" 2>/dev/null
exit "$status"
