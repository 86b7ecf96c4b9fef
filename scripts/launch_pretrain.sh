#!/usr/bin/env bash
# Shared by scripts/pretrain_<model>.sh: torchrun over NNODES x GPUS_PER_NODE with configs/<model>.yaml.
#
#   CONFIG=/path/to/configs/llama3.1_8b.yaml bash scripts/launch_pretrain.sh [extra trainer flags...]
#
# Environment (defaults in brackets):
#   NNODES [1] NODE_RANK [0] MASTER_ADDR [localhost] MASTER_PORT [6000] GPUS_PER_NODE [all visible GPUs]
#   DATA_PATH        indexed-dataset prefix(es), 'W1 P1 W2 P2' for a blend  [unset: --mock-data]
#   TOKENIZER_MODEL  SentencePiece .model or HF tokenizer.json directory    [needed with DATA_PATH]
#   RUN_DIR          checkpoints, logs, TensorBoard   [./runs/<config name>, ./runs/<config name>_bf16 for bf16]
#   PRECISION        int8 (adds --int8-linear) or bf16 (the baseline)        [int8]
#   MEGATRON_LM      a Megatron-LM checkout (core_v0.16.1 ... core_v0.19.0, unpatched): run its pretrain_gpt.py
#                    through `python -m megatron_int8.megatron_lm run` (docs/megatron-lm.md)
#                    with the same YAML as flags (docs/megatron-lm.md)       [unset: this trainer]
# Extra arguments are passed to the trainer last, so they override the YAML.
set -euo pipefail
: "${CONFIG:?set CONFIG=configs/<model>.yaml}"
NAME=$(basename "$CONFIG" .yaml)
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
# named here, before torchrun starts (a NODE_RANK beyond NNODES names a node the job does not have)
if [[ ! "$NNODES" =~ ^[1-9][0-9]*$ || ! "$NODE_RANK" =~ ^(0|[1-9][0-9]*)$ ]] || (( NODE_RANK >= NNODES )); then
    echo "NNODES must be a positive integer and NODE_RANK one of 0 to NNODES - 1, got NNODES='$NNODES'" \
         "NODE_RANK='$NODE_RANK'" >&2
    exit 2
fi
if [[ ! "$MASTER_PORT" =~ ^[1-9][0-9]*$ ]] || (( MASTER_PORT > 65535 )); then
    echo "MASTER_PORT must be a port number (1 to 65535), got '$MASTER_PORT'" >&2
    exit 2
fi
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
    [[ "$GPUS_PER_NODE" -gt 0 ]] || GPUS_PER_NODE=1  # no GPU seen: one process
elif [[ ! "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    echo "GPUS_PER_NODE must be a positive integer (processes per node), got '$GPUS_PER_NODE'" >&2
    exit 2
fi
PRECISION=${PRECISION:-int8}
# each precision its own run (a BF16 baseline must not resume the INT8 run's checkpoints, nor append to its log)
RUN_DIR=${RUN_DIR:-runs/$NAME$([[ "$PRECISION" == bf16 ]] && echo _bf16 || true)}
PYTHON=${PYTHON:-python3}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # TP/SP communication overlap ordering

case "$PRECISION" in
    int8) PRECISION_ARGS=(--int8-linear) ;;
    bf16) PRECISION_ARGS=() ;;
    *) echo "PRECISION must be int8 or bf16, got '$PRECISION'" >&2; exit 2 ;;
esac
if [[ -n "${DATA_PATH:-}" ]]; then
    : "${TOKENIZER_MODEL:?set TOKENIZER_MODEL with DATA_PATH}"
    read -r -a DATA_WORDS <<< "$DATA_PATH"
    DATA_ARGS=(--data-path "${DATA_WORDS[@]}" --tokenizer-model "$TOKENIZER_MODEL")
else
    echo "DATA_PATH not set: training on mock data (a smoke run)"
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer)
fi
OUTPUT_ARGS=(--save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --tensorboard-dir "$RUN_DIR/tensorboard")
mkdir -p "$RUN_DIR"
LAUNCH=(torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")

if [[ -n "${MEGATRON_LM:-}" ]]; then
    [[ -f "$MEGATRON_LM/pretrain_gpt.py" ]] || { echo "MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py" >&2; exit 2; }
    YAML_TEXT=$("$PYTHON" -m megatron_int8.megatron_lm "$CONFIG") || exit 2  # a bad CONFIG stops here
    YAML_ARGS=()
    [[ -z "$YAML_TEXT" ]] || mapfile -t YAML_ARGS <<< "$YAML_TEXT"
    set -x
    exec "${LAUNCH[@]}" -m megatron_int8.megatron_lm run "$MEGATRON_LM/pretrain_gpt.py" "${YAML_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
        "${PRECISION_ARGS[@]}" "$@"
fi
set -x
exec "${LAUNCH[@]}" -m megatron_int8.pretrain --config "$CONFIG" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    --log-jsonl "$RUN_DIR/train_log.jsonl" "${PRECISION_ARGS[@]}" "$@"
