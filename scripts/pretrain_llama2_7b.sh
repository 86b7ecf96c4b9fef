#!/usr/bin/env bash
# Pretrain llama2_7b (configs/llama2_7b.yaml) with INT8 linears; PRECISION=bf16 for the baseline.
# Environment and arguments: see scripts/launch_pretrain.sh. Example, one node of 8 GPUs:
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/tokenizer bash scripts/pretrain_llama2_7b.sh
CONFIG="$(dirname "$0")/../configs/llama2_7b.yaml" exec bash "$(dirname "$0")/launch_pretrain.sh" "$@"
