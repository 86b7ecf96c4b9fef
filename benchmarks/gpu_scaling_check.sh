#!/usr/bin/env bash
# One device call (nvidia-h200-x4, repo root, .whl with megatron-core carried): INT8 vs BF16 scale-out runs
# of issue #7 through benchmarks/bench_scaling.py (full-depth models, mock data, NCCL). Table, per-run JSON
# results and logs go to $OUT; docs/scaling.md says how the calls are split and merged.
#
#   LAYOUTS="llama2_7b-tp2sp-dp2" VARIANTS="bf16 int8 int8-int8ag" bash benchmarks/gpu_scaling_check.sh  # call 1
#   LAYOUTS="llama2_7b-tp2sp-dp2" VARIANTS="int8-tensor int8-tensor-int8ag" bash ...                # call 1b
#   LAYOUTS="mixtral_8x7b_8l-ep4 llama2_13b-tp4sp" bash benchmarks/gpu_scaling_check.sh    # call 2 (4 runs)
#   SMOKE=1 bash benchmarks/gpu_scaling_check.sh                                           # CPU plumbing check
#
# Environment: LAYOUTS (default: bench_scaling.py's three 4-GPU layouts), VARIANTS (bf16 int8 int8-int8ag int8-tensor int8-tensor-int8ag;
# default: each layout's own), ITERS [50], WARMUP [5],
# DEADLINE [460] seconds for all runs (a device command has 600 s; the install comes first), RUN_TIMEOUT
# [400], EXTRA (more trainer flags for every run, e.g. "--recompute-granularity selective"), GRAD_ACCUM [1]
# (micro-batches per step per GPU), MICRO_BATCH [1] (sequences per micro-batch), DATA_PATH + TOKENIZER_MODEL (a tokenized corpus instead of mock data).
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ! python3 -c "import megatron.core" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# NVLink multicast (NVLS) and symmetric-memory multicast stay off on the lent machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 CUDA_DEVICE_MAX_CONNECTIONS=1

ARGS=(--iters "${ITERS:-50}" --warmup "${WARMUP:-5}" --deadline "${DEADLINE:-460}" --run-timeout "${RUN_TIMEOUT:-400}"
      --out-dir "$OUT")
[[ -n "${LAYOUTS:-}" ]] && ARGS+=(--layouts $LAYOUTS)
[[ -n "${VARIANTS:-}" ]] && ARGS+=(--variants $VARIANTS)
[[ -n "${SMOKE:-}" ]] && ARGS+=(--smoke)
[[ -n "${GRAD_ACCUM:-}" ]] && ARGS+=(--grad-accum "$GRAD_ACCUM")
[[ -n "${MICRO_BATCH:-}" ]] && ARGS+=(--micro-batch-size "$MICRO_BATCH")
[[ -n "${DATA_PATH:-}" ]] && ARGS+=(--data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL")
[[ -n "${EXTRA:-}" ]] && ARGS+=(--extra $EXTRA)

if [[ -z "${SMOKE:-}" ]]; then
    { nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } 2>&1 | tee "$OUT/gpu.txt"
fi
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'mcore', m.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee -a "$OUT/gpu.txt"
python3 benchmarks/bench_scaling.py "${ARGS[@]}" 2>&1 | tee "$OUT/bench_scaling.log" | grep -E "^==|^  [a-z]|failed|^\||INT8 SP all-gather|^table"
exit "${PIPESTATUS[0]}"
