#!/usr/bin/env bash
# One call on the GPU machine (run from the repo root, .whl carried): GPU kernel tests, then the benchmark.
#   bash benchmarks/gpu_kernels_check.sh            # env: TEST_TIMEOUT, BENCH_TIMEOUT, BENCH_ARGS, SKIP_TESTS
# BENCH_ARGS defaults to --quick (Llama2-7B + the quantize table, so tests + benchmark fit in ~5 minutes);
# BENCH_ARGS=" " runs the full benchmark.
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ -z "$SKIP_TESTS" ]; then
  # fixed GEMM tiles (TMA where eligible) for the bulk of the tests (one compile per variant); test_gemm_autotuned_path re-enables tuning
  MEGATRON_INT8_GEMM_AUTOTUNE=0 timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -rf \
    tests/kernels/test_kernels_gpu.py $TEST_ARGS 2>&1 | tee "$OUT/tests.log" | tail -25
fi
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_kernels.py ${BENCH_ARGS---quick} 2>&1 | tee "$OUT/bench.log" | grep -v "^|" 
cat "$OUT/bench_kernels.md" 2>/dev/null
