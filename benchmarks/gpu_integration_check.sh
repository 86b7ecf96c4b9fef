#!/usr/bin/env bash
# One call on the GPU machine (repo root, .whl with megatron-core carried): the megatron-core GPU tests,
# then the Llama2-7B layer benchmark (INT8 vs BF16 vs stock local spec) with and without the weight cache
# and with the immediate finite check (a host sync per quantize). Logs and tables go to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'mcore', m.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -rf tests/megatron/test_layers_gpu.py 2>&1 | tee "$OUT/layers_tests.log" | tail -8
for opts in "" "--cache-weights --no-stock" "--cache-weights --check-finite immediate --no-stock" ${EXTRA_BENCH:+"$EXTRA_BENCH"}; do
  echo "== bench_layer.py $opts"
  timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_layer.py $opts 2>&1 | tee -a "$OUT/bench_layer.log" | grep -E "^\||fwd\+bwd|Error|error"
done
