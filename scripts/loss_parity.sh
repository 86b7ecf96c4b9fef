#!/usr/bin/env bash
# INT8 vs BF16 loss parity in one command: a ~125M Llama-style model (configs/parity_125m.yaml) trained
# twice with the project's trainer, same seed and data order, on a corpus already on the machine (the
# Python sources of site-packages: no downloads), with a held-out validation split. Writes both JSONL
# logs, a PNG with training and validation curves, and a summary table (last-100-iteration mean training
# loss, final validation loss, relative gap) to RUN_DIR (default runs/parity; $OUT too when set).
#
#     bash scripts/loss_parity.sh [extra trainer flags for both runs, e.g. --train-iters 500]
#     INT8_FLAGS="--int8-granularity row" bash scripts/loss_parity.sh     # another recipe for the INT8 run
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/parity}
PYTHON=${PYTHON:-python3}
CORPUS_MB=${CORPUS_MB:-80}
VOCAB=${VOCAB:-8192}
WORKERS=${WORKERS:-$(nproc)}
read -r -a INT8_EXTRA <<< "${INT8_FLAGS:-}"
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
mkdir -p "$RUN_DIR"

if [[ ! -f "$RUN_DIR/corpus.jsonl" ]]; then
    echo "== corpus: Python sources of site-packages (${CORPUS_MB} MB)"
    "$PYTHON" scripts/prepare_tiny_corpus.py --source site-packages --output "$RUN_DIR/corpus.jsonl" --max-mb "$CORPUS_MB"
fi
PREFIX="$RUN_DIR/data/corpus"
if [[ ! -f "${PREFIX}_text_document.bin" ]]; then
    echo "== SentencePiece ($VOCAB tokens) + indexed dataset"
    "$PYTHON" scripts/preprocess_data.py --input "$RUN_DIR/corpus.jsonl" --json-keys text \
        --output-prefix "$PREFIX" --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model "$RUN_DIR/tokenizer/spm.model" --train-sentencepiece "$VOCAB" --workers "$WORKERS"
fi

for precision in bf16 int8; do
    flags=()
    [[ "$precision" == "int8" ]] && flags=(--int8-linear "${INT8_EXTRA[@]}")
    echo "== training $precision ${flags[*]}"
    set +e
    "$PYTHON" -m megatron_int8.pretrain --config configs/parity_125m.yaml \
        --data-path "${PREFIX}_text_document" --tokenizer-model "$RUN_DIR/tokenizer/spm.model" \
        --data-cache-path "$RUN_DIR/data/cache" --log-jsonl "$RUN_DIR/$precision.jsonl" "${flags[@]}" "$@" \
        2>&1 | tee "$RUN_DIR/$precision.log" | grep --line-buffered -E "iteration|validation|error|Error"
    status=${PIPESTATUS[0]}
    set -e
    [[ $status -eq 0 ]] || { echo "$precision run failed (exit $status): see $RUN_DIR/$precision.log"; exit 1; }
done

"$PYTHON" scripts/plot_loss.py "$RUN_DIR/bf16.jsonl" "$RUN_DIR/int8.jsonl" --labels BF16 INT8 \
    --output "$RUN_DIR/loss_parity.png" --title "125M Llama-style model: INT8 vs BF16" --summary "$RUN_DIR/summary.md"
cat "$RUN_DIR/summary.md"
if [[ -n "${OUT:-}" ]]; then cp "$RUN_DIR"/{bf16.jsonl,int8.jsonl,loss_parity.png,summary.md} "$OUT"/; fi
