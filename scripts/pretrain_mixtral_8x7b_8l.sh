#!/usr/bin/env bash
# Pretrain mixtral_8x7b_8l (configs/mixtral_8x7b_8l.yaml) with INT8 linears; PRECISION=bf16 for the baseline.
# Environment and arguments: see scripts/launch_pretrain.sh. Example, one node of 8 GPUs:
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/tokenizer bash scripts/pretrain_mixtral_8x7b_8l.sh
CONFIG="$(dirname "$0")/../configs/mixtral_8x7b_8l.yaml" exec bash "$(dirname "$0")/launch_pretrain.sh" "$@"
