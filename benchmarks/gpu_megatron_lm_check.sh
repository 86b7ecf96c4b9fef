#!/usr/bin/env bash
# Upstream Megatron-LM's own pretrain_gpt.py (any tag core_v0.16.1 ... core_v0.19.0, unpatched, through
# `python -m megatron_int8.megatron_lm run`) on ONE GPU: a 4-layer model of Llama2-7B's width (hidden 4096, 32 heads,
# FFN 11008, seq 4096) on mock data, first with --int8-linear, then the same run in BF16 with the INT8 spec's
# attention and norms (bf16_spec: --int8-linear with every linear in --int8-bf16-modules), then (PRECISIONS with
# bf16) in BF16 with upstream's local spec (whose attention is unfused). One call on the GPU machine, from the
# repository root:
#
#   MLM=third_party/megatron-lm bash benchmarks/gpu_megatron_lm_check.sh
#
# Needs MLM (bash scripts/fetch_megatron_lm.sh /path/to/Megatron-LM DIR) and, where megatron-core is not installed,
# PYTHONPATH naming one (benchmarks/gpu_versions_check.sh sets it up from .whl). Logs go to $OUT (default /tmp/out):
# megatron_lm_{int8,bf16_spec,bf16}.log and the iteration lines.
# Environment: ITERS [20], RUN_TIMEOUT [240 s per run], PRECISIONS ["int8 bf16_spec"], EXTRA_ARGS (appended to every
# run), WIDTH [llama2_7b, or small: hidden 1024], PRINT_ARGS=1 (print the pretrain_gpt.py flags and exit; no GPU).
set -o pipefail
OUT=${OUT:-/tmp/out}
ROOT=$PWD
MLM=$(cd "${MLM:-$ROOT/third_party/megatron-lm}" 2>/dev/null && pwd) || { echo "no MLM folder: bash scripts/fetch_megatron_lm.sh /path/to/Megatron-LM DIR" >&2; exit 2; }
ITERS=${ITERS:-20}
mkdir -p "$OUT"
[ -f "$MLM/pretrain_gpt.py" ] || { echo "no $MLM/pretrain_gpt.py" >&2; exit 2; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$ROOT
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# 2. Flags. environment_argv(): --transformer-impl local --no-rope-fusion without Transformer Engine,
#    --no-gradient-accumulation-fusion without APEX. Upstream's local spec (the BF16 run) also needs, without
#    APEX: --no-masked-softmax-fusion (else it imports APEX's scaled_masked_softmax_cuda at the first forward)
#    and --no-persist-layer-norm (else its torch RMSNorm refuses to build).
mapfile -t ENV_ARGS < <(python3 -c "from megatron_int8.megatron_lm import environment_argv; print(*environment_argv(), sep='\n')") || exit 1
python3 -c "import scaled_masked_softmax_cuda" 2>/dev/null || ENV_ARGS+=(--no-masked-softmax-fusion)
if [ "${WIDTH:-llama2_7b}" = small ]; then
  MODEL_ARGS=(--num-layers 4 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16
              --group-query-attention --num-query-groups 4 --kv-channels 64 --seq-length 1024 --max-position-embeddings 1024)
else
  MODEL_ARGS=(--num-layers 4 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --kv-channels 128
              --seq-length 4096 --max-position-embeddings 4096)
fi
MODEL_ARGS+=(
  --position-embedding-type rope --rotary-base 10000
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
TRAIN_ARGS=(
  --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --seed 1234
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --eval-iters 0 --eval-interval 100000 --log-interval 5 --log-throughput --num-workers 1
  --distributed-timeout-minutes 5
)
ARGS=("${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${ENV_ARGS[@]}")
if [ -n "$PRINT_ARGS" ]; then printf '%s\n' "${ARGS[@]}" --int8-linear $EXTRA_ARGS; exit 0; fi

# 4. Megatron-LM's initialize runs `make -C <megatron.core>/datasets` on rank 0 (exit 1 if make fails).
#    The wheel has the compiled helpers_cpp but not upstream's Makefile: give it one whose target is that
#    file (built only if missing), and a `make` that only checks the import where make is absent.
DATASETS=$(python3 -c "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))") || exit 1
if [ ! -f "$DATASETS/Makefile" ] && [ -w "$DATASETS" ]; then
  cat > "$DATASETS/Makefile" <<'EOF'
# written by megatron-int8's benchmarks/gpu_megatron_lm_check.sh (the wheel ships helpers_cpp prebuilt)
LIBEXT = $(shell python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
OUT = helpers_cpp$(LIBEXT)
default: $(OUT)
$(OUT): helpers.cpp
	$(CXX) -O3 -Wall -shared -std=c++17 -fPIC $(shell python3 -m pybind11 --includes) $< -o $@
EOF
  touch "$DATASETS"/helpers_cpp*.so 2>/dev/null
fi
if ! command -v make >/dev/null; then
  mkdir -p /tmp/mlm-shims && printf '#!/bin/sh\nexec python3 -c "import megatron.core.datasets.helpers_cpp"\n' > /tmp/mlm-shims/make
  chmod +x /tmp/mlm-shims/make && export PATH=/tmp/mlm-shims:$PATH
fi
# 5. ...and megatron/legacy/fused_kernels.load() runs `$CUDA_HOME/bin/nvcc -V` only to pick -gencode flags
#    (it builds nothing). Without an nvcc there, a stand-in that reports torch's CUDA version.
if ! python3 -c "import os, sys; from torch.utils.cpp_extension import CUDA_HOME as h; sys.exit(not (h and os.access(h + '/bin/nvcc', os.X_OK)))" 2>/dev/null; then
  mkdir -p /tmp/mlm-cuda/bin && v=$(python3 -c "import torch; print(torch.version.cuda or '12.0')")
  printf '#!/bin/sh\necho "Cuda compilation tools, release %s, V%s (stand-in for megatron/legacy/fused_kernels)"\n' "$v" "$v" > /tmp/mlm-cuda/bin/nvcc
  chmod +x /tmp/mlm-cuda/bin/nvcc && export CUDA_HOME=/tmp/mlm-cuda
fi

# 6. The launcher runs `megatron_lm.run` (upstream's script, unchanged, as __main__) and only wraps
#    megatron.training.training.get_model to print the per-linear precision table of the built model.
mkdir -p /tmp/mlm-launch
cat > /tmp/mlm-launch/pretrain_gpt_with_table.py <<'EOF'
import sys
mlm = sys.argv.pop(1)
sys.path.insert(0, mlm)
import megatron.core, megatron.training.training as training
from megatron.core.utils import unwrap_model
from megatron_int8 import megatron_lm
from megatron_int8.megatron.cli import policy_from_args
from megatron_int8.megatron.precision_table import print_precision_table
print(f"megatron.core {megatron.core.__version__} from {megatron.core.__path__[0]}; megatron.training from "
      f"{training.__file__}", flush=True)
get_model = training.get_model
def get_model_and_print_table(*args, **kwargs):
    model = get_model(*args, **kwargs)
    flags = megatron_lm.int8_args()
    print_precision_table(unwrap_model(model), policy_from_args(flags) if flags.int8_linear else None,
                          print_fn=lambda table: print(table, flush=True))
    return model
training.get_model = get_model_and_print_table
megatron_lm.run([f"{mlm}/pretrain_gpt.py"] + sys.argv[1:])
EOF

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
status=0
for precision in ${PRECISIONS:-int8 bf16_spec}; do
  case $precision in
    int8) flags=(--int8-linear) ;;
    bf16_spec) flags=(--int8-linear --int8-bf16-modules linear_qkv linear_proj linear_fc1 linear_fc2) ;;
    bf16) flags=() ;;
    *) echo "PRECISIONS: int8, bf16_spec or bf16, got '$precision'" >&2; exit 2 ;;
  esac
  log=$OUT/megatron_lm_$precision.log
  echo "== Megatron-LM pretrain_gpt.py, $precision: torchrun --nproc-per-node 1 ... ${flags[*]} $EXTRA_ARGS"
  start=$(date +%s)
  timeout "${RUN_TIMEOUT:-240}" torchrun --standalone --nproc-per-node 1 /tmp/mlm-launch/pretrain_gpt_with_table.py "$MLM" \
    "${ARGS[@]}" "${flags[@]}" $EXTRA_ARGS > "$log" 2>&1
  rc=$?
  echo "exit $rc after $(( $(date +%s) - start )) s ($log)"
  grep -E "^megatron.core |INT8 precision table|^\| " "$log" | head -40
  grep -E " iteration +[0-9]+/" "$log" | sed -E 's/^ *\[[^]]*\] *//' | tee "$OUT/iterations_$precision.txt"
  if [ "$rc" -ne 0 ]; then
    status=1
    grep -E "Error|error|Traceback|Killed" "$log" | grep -v -i warn | tail -15
    tail -30 "$log"
  fi
done
exit $status
