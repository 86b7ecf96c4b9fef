#!/usr/bin/env bash
# The embedded default: pretrain a tiny Llama-style model with INT8 linears on text already on this
# machine (Python's standard-library sources), no downloads. Run after `pip install -e .`:
#
#     bash scripts/run_tiny.sh [extra trainer flags, e.g. --train-iters 100]
#     PRECISION=bf16 bash scripts/run_tiny.sh      # the same without INT8 (the baseline), under RUN_DIR/bf16
#     PRECISION=both bash scripts/run_tiny.sh      # INT8, then BF16, and both curves on one chart
#
# Run again, it resumes from the last checkpoint in runs/tiny/checkpoints (with --train-iters N, up to N);
# Ctrl-C saves and exits (--exit-signal-handler). A fresh start: another RUN_DIR, or delete runs/tiny.
#
# Steps (corpus and tokenizer are reused when present): corpus -> SentencePiece tokenizer ->
# indexed dataset -> pretraining (CPU, or GPU with --bf16 if one is present) -> loss-curve PNG.
# Everything goes under runs/tiny (RUN_DIR to change it): the INT8 run's checkpoints/, train_log.jsonl and
# loss.png there, the BF16 run's under runs/tiny/bf16 (its own checkpoints: the two never resume each other).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/tiny}
PRECISION=${PRECISION:-int8}
case "$PRECISION" in int8|bf16|both) ;; *) echo "PRECISION=$PRECISION: expected int8, bf16 or both" >&2; exit 2;; esac
PYTHON=${PYTHON:-python3}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
mkdir -p "$RUN_DIR"
started=$(date +%s)
# Ctrl-C: the trainer saves and exits 0 (--exit-signal-handler), so stop here rather than go on to the next step
trap 'echo "interrupted: checkpoints kept under $RUN_DIR; run again to resume" >&2; exit 130' INT

if [[ ! -f "$RUN_DIR/corpus.jsonl" ]]; then
    echo "== 1/4 corpus from the Python standard library"
    "$PYTHON" scripts/prepare_tiny_corpus.py --output "$RUN_DIR/corpus.jsonl" --max-mb 8
else
    echo "== 1/4 corpus: reusing $RUN_DIR/corpus.jsonl"
fi

DATA_PREFIX="$RUN_DIR/data/stdlib"
if [[ ! -f "$RUN_DIR/tokenizer/spm.model" ]]; then
    echo "== 2/4 SentencePiece tokenizer (4096 tokens) + 3/4 indexed dataset"
    for ckpt in "$RUN_DIR/checkpoints" "$RUN_DIR/bf16/checkpoints"; do
        if [[ -f "$ckpt/latest_checkpointed_iteration.txt" ]]; then
            echo "error: $RUN_DIR/tokenizer/spm.model is missing but $ckpt holds checkpoints trained on its token ids:" \
                 "restore the tokenizer, or start over in another RUN_DIR (or delete $RUN_DIR)" >&2
            exit 2
        fi
    done
    # a new tokenizer invalidates the old token ids and the index caches built on them
    rm -rf "${DATA_PREFIX}_text_document.bin" "${DATA_PREFIX}_text_document.idx" "$RUN_DIR/data/cache"
    "$PYTHON" scripts/preprocess_data.py --input "$RUN_DIR/corpus.jsonl" --json-keys text \
        --output-prefix "$DATA_PREFIX" --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model "$RUN_DIR/tokenizer/spm.model" --train-sentencepiece 4096 --workers 2
elif [[ ! -f "${DATA_PREFIX}_text_document.bin" ]]; then
    echo "== 2/4 tokenizer: reusing $RUN_DIR/tokenizer/spm.model; 3/4 indexed dataset"
    rm -rf "${DATA_PREFIX}_text_document.idx" "$RUN_DIR/data/cache"  # an index without its .bin: an interrupted build
    "$PYTHON" scripts/preprocess_data.py --input "$RUN_DIR/corpus.jsonl" --json-keys text \
        --output-prefix "$DATA_PREFIX" --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model "$RUN_DIR/tokenizer/spm.model" --workers 2
else
    echo "== 2/4 tokenizer and 3/4 dataset: reusing $RUN_DIR/tokenizer, $RUN_DIR/data"
fi

train_one() {  # PRECISION OUT_DIR [trainer flags]: one run, resumed from OUT_DIR/checkpoints when there
    local precision=$1 out=$2
    shift 2
    local flags=()
    [[ "$precision" == "int8" ]] && flags+=(--int8-linear)
    if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        flags+=(--bf16)
    fi
    mkdir -p "$out"
    echo "== 4/4 pretraining ($precision${flags[*]:+: ${flags[*]}}) into $out"
    "$PYTHON" -m megatron_int8.pretrain --config configs/tiny.yaml \
        --data-path "${DATA_PREFIX}_text_document" --tokenizer-model "$RUN_DIR/tokenizer/spm.model" \
        --data-cache-path "$RUN_DIR/data/cache" --save "$out/checkpoints" --load "$out/checkpoints" \
        --exit-signal-handler --log-jsonl "$out/train_log.jsonl" "${flags[@]}" "$@"
    "$PYTHON" scripts/plot_loss.py "$out/train_log.jsonl" --labels "tiny $precision" \
        --output "$out/loss.png" --title "Tiny Llama-style model, $precision linears" \
        || echo "(no loss plot: see the message above; the JSONL log is complete)"
}

[[ "$PRECISION" != "bf16" ]] && train_one int8 "$RUN_DIR" "$@"
[[ "$PRECISION" != "int8" ]] && train_one bf16 "$RUN_DIR/bf16" "$@"
if [[ "$PRECISION" == "both" ]]; then
    "$PYTHON" scripts/plot_loss.py "$RUN_DIR/train_log.jsonl" "$RUN_DIR/bf16/train_log.jsonl" --labels INT8 BF16 \
        --output "$RUN_DIR/loss_both.png" --title "Tiny Llama-style model: INT8 vs BF16 linears" \
        || echo "(no comparison plot: see the message above)"
    echo "both curves: $RUN_DIR/loss_both.png"
fi
echo "done in $(( $(date +%s) - started )) s under $RUN_DIR"
