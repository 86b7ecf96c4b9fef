#!/usr/bin/env bash
# INT8 vs BF16 loss parity in one command: a ~125M Llama-style model (configs/parity_125m.yaml) trained
# twice with the project's trainer, same seed and data order, on a corpus already on the machine (the
# Python sources of site-packages; with CORPUS=docstrings the English prose of the standard library's and
# site-packages' docstrings: no downloads), with a held-out validation split. Writes both JSONL
# logs, a PNG with training and validation curves, and a summary table (last-100-iteration mean training
# loss, final validation loss, relative gap) to RUN_DIR (default runs/parity; $OUT too when set).
#
#     bash scripts/loss_parity.sh [extra trainer flags for every run, e.g. --exit-interval 800]
#     INT8_FLAGS="--int8-granularity block" bash scripts/loss_parity.sh   # another recipe for the INT8 run
#     VARIANTS="bf16 int8_row int8_block int8_wgrad_bf16 int8_sr" bash scripts/loss_parity.sh   # ablation
#     PARALLEL=1 VARIANTS="bf16 int8 int8_row_sr" bash scripts/loss_parity.sh   # all at once, one GPU (0: in turn)
#     CORPUS=docstrings VARIANTS="bf16 bf16_seed2 int8" bash scripts/loss_parity.sh  # on English prose
# Variants: bf16; bf16_seed2 (BF16 with another seed, so another init and data order: the noise floor
# next to each gap); int8 (the default recipe + INT8_FLAGS); and, each with its gradient rounding stated so the
# ablation means the same whatever the default: int8_nearest / int8_sr (tensorwise, gradients rounded to
# nearest / stochastically), int8_row, int8_block, int8_wgrad_bf16 (wgrad in BF16), int8_dgrad_wgrad_bf16
# (only fprop INT8) -- all four with nearest rounding -- int8_row_sr, int8_first_last_bf16 (default recipe).
# Memory options (issue #46), each on the default recipe: int8_optimizer (INT8 Adam moments + master-weight
# remainders, on the distributed optimizer they need), int8_swiglu_input, int8_norm_input (activations saved in
# INT8), and int8_memory, the stack that bench_e2e measures (optimizer + SwiGLU input + the Q(W)-only weight
# cache) with the health statistics and the auto fallback on, so its JSONL also shows whether a fallback fires
# on a healthy run. int8_attention: the default recipe with --int8-attention (attention's products in INT8 too, its
# scores Q K^T from BF16 Q and K by default); int8_attention_int8_scores: the same with --int8-attention-scores int8.
set -euo pipefail
for word in "$@"; do  # the header above is the help (the other flags are the trainer's)
    if [[ $word == -h || $word == --help ]]; then
        sed -n '2,/^set -euo pipefail$/{/^set /d; s/^# \{0,1\}//; p}' "$0"
        exit 0
    fi
done
cd "$(dirname "$0")/.."
CORPUS=${CORPUS:-source}
case $CORPUS in
    source) RUN_DIR=${RUN_DIR:-runs/parity} ;;
    docstrings) RUN_DIR=${RUN_DIR:-runs/parity_docstrings} ;;
    *) echo "CORPUS must be source or docstrings, got '$CORPUS'" >&2; exit 2 ;;
esac
PARALLEL=${PARALLEL:-0}
case $PARALLEL in
    0|1) ;;
    *) echo "PARALLEL must be 0 (the variants one after another) or 1 (all at once), got '$PARALLEL'" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
CORPUS_MB=${CORPUS_MB:-80}
VOCAB=${VOCAB:-8192}
WORKERS=${WORKERS:-$(nproc)}
read -r -a INT8_EXTRA <<< "${INT8_FLAGS:-}"
read -r -a RUNS <<< "${VARIANTS:-bf16 int8}"
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
PREFIX="$RUN_DIR/data/corpus"

PRECISION_AWARE="--use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype int8 --exp-avg-sq-dtype int8 --store-param-remainders"
variant_flags() {
    case "$1" in
        bf16) ;;
        bf16_seed2) echo --seed 4321 ;;
        int8) echo --int8-linear "${INT8_EXTRA[@]}" ;;
        int8_nearest) echo --int8-linear --int8-grad-rounding nearest ;;
        int8_sr) echo --int8-linear --int8-grad-rounding stochastic ;;
        int8_row) echo --int8-linear --int8-granularity row --int8-grad-rounding nearest ;;
        int8_row_sr) echo --int8-linear --int8-granularity row --int8-grad-rounding stochastic ;;
        int8_block) echo --int8-linear --int8-granularity block --int8-grad-rounding nearest ;;
        int8_wgrad_bf16) echo --int8-linear --int8-bf16-gemms wgrad --int8-grad-rounding nearest ;;
        int8_dgrad_wgrad_bf16) echo --int8-linear --int8-bf16-gemms dgrad,wgrad --int8-grad-rounding nearest ;;
        int8_first_last_bf16) echo --int8-linear --int8-first-last-layers-bf16 ;;
        int8_optimizer) echo --int8-linear $PRECISION_AWARE ;;
        int8_swiglu_input) echo --int8-linear --int8-swiglu-input ;;
        int8_norm_input) echo --int8-linear --int8-norm-input ;;
        int8_attention) echo --int8-linear --int8-attention ;;
        int8_attention_int8_scores) echo --int8-linear --int8-attention --int8-attention-scores int8 ;;
        int8_memory) echo --int8-linear $PRECISION_AWARE --int8-swiglu-input --int8-no-dgrad-weight-cache \
            --int8-stats-interval 100 --int8-auto-fallback ;;
        *) echo "unknown variant '$1' in VARIANTS: the variants are listed at the top of scripts/loss_parity.sh" >&2
           return 1 ;;
    esac
}
for v in "${RUNS[@]}"; do variant_flags "$v" > /dev/null || exit 2; done

trainer_argv() {  # trainer_argv NAME [extra flags]: the trainer's arguments for one variant's run, into ARGV
    local flags cache=cache
    read -r -a flags <<< "$(variant_flags "$1")"
    [[ $PARALLEL == 0 ]] || cache=cache_$1  # runs at once: each its own index cache, so no two write the same files
    ARGV=(--config configs/parity_125m.yaml --data-path "${PREFIX}_text_document"
          --tokenizer-model "$RUN_DIR/tokenizer/spm.model" --data-cache-path "$RUN_DIR/data/$cache"
          --log-jsonl "$RUN_DIR/$1.jsonl" "${flags[@]}" "${@:2}")
}

# check_flags parse|validate [extra flags]: every variant's trainer command through the trainer's own checks, in one
# process (their notes are the runs' to print): a bad flag stops the script before the data is built (parse: the
# flags' names and values) and before any run trains (validate: the checks the trainer makes before it reads the data,
# which need the tokenizer), not after the runs before it trained
check_flags() {
    local commands=() v
    for v in "${RUNS[@]}"; do trainer_argv "$v" "${@:2}"; commands+=("::variant=$v" "${ARGV[@]}"); done
    "$PYTHON" - "$1" "${commands[@]}" > /dev/null <<'PY'
import contextlib
import io
import os
import sys

from megatron_int8.megatron.cli import policy_from_args
from megatron_int8.training.args import parse_args, validate_args

commands = []
for word in sys.argv[2:]:
    if word.startswith("::variant="):
        commands.append((word[len("::variant="):], []))
    else:
        commands[-1][1].append(word)
for variant, argv in commands:
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            args = parse_args(argv)
        if sys.argv[1] == "validate":  # as the trainer calls them
            policy_from_args(validate_args(args, int(os.environ.get("WORLD_SIZE", "1"))))
    except SystemExit:  # argparse printed its usage, then "PROG: error: MESSAGE"
        message = usage.getvalue().strip().splitlines()[-1].split(": error: ", 1)[-1]
    except ValueError as err:  # ArgumentError, and the INT8 recipe's (the trainer names both)
        message = str(err)
    else:
        continue
    print(f"error: variant {variant}: {message}", file=sys.stderr)
    sys.exit(2)
PY
}
check_flags parse "$@"

if [[ -f "$RUN_DIR/corpus.jsonl" && "$(cat "$RUN_DIR/corpus.kind" 2>/dev/null || echo source)" != "$CORPUS" ]]; then
    echo "$RUN_DIR holds a corpus of kind '$(cat "$RUN_DIR/corpus.kind" 2>/dev/null || echo source)', not '$CORPUS':" \
        "give another RUN_DIR" >&2
    exit 2
fi
mkdir -p "$RUN_DIR"
if [[ ! -f "$RUN_DIR/corpus.jsonl" ]]; then
    if [[ $CORPUS == docstrings ]]; then
        echo "== corpus: docstrings of the standard library and site-packages (up to ${CORPUS_MB} MB)"
        "$PYTHON" scripts/prepare_tiny_corpus.py --source all --text docstrings --output "$RUN_DIR/corpus.jsonl" \
            --max-mb "$CORPUS_MB"
    else
        echo "== corpus: Python sources of site-packages (${CORPUS_MB} MB)"
        "$PYTHON" scripts/prepare_tiny_corpus.py --source site-packages --output "$RUN_DIR/corpus.jsonl" --max-mb "$CORPUS_MB"
    fi
    echo "$CORPUS" > "$RUN_DIR/corpus.kind"
fi
# the data's settings: a RUN_DIR built with others is refused, not silently reused
SETTINGS="CORPUS_MB=$CORPUS_MB VOCAB=$VOCAB"
if [[ -f "$RUN_DIR/data.settings" && "$(cat "$RUN_DIR/data.settings")" != "$SETTINGS" ]]; then
    echo "$RUN_DIR holds data built with $(cat "$RUN_DIR/data.settings"), not $SETTINGS: give another RUN_DIR" \
        "(or those settings)" >&2
    exit 2
fi
if [[ ! -f "${PREFIX}_text_document.bin" ]]; then
    echo "== SentencePiece ($VOCAB tokens) + indexed dataset"
    "$PYTHON" scripts/preprocess_data.py --input "$RUN_DIR/corpus.jsonl" --json-keys text \
        --output-prefix "$PREFIX" --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model "$RUN_DIR/tokenizer/spm.model" --train-sentencepiece "$VOCAB" --workers "$WORKERS" \
        --force  # no .bin yet: a tokenizer left by an interrupted run is made again, the same from the same corpus
fi
[[ -f "$RUN_DIR/data.settings" ]] || echo "$SETTINGS" > "$RUN_DIR/data.settings"
check_flags validate "$@"

train_variant() {  # train_variant NAME [extra flags]: one run, its log in $RUN_DIR/NAME.{log,jsonl}
    local precision=$1
    trainer_argv "$@"
    echo "== training $precision $(variant_flags "$precision")"
    set +e
    "$PYTHON" -m megatron_int8.pretrain "${ARGV[@]}" \
        2>&1 | tee "$RUN_DIR/$precision.log" | grep --line-buffered -E "iteration|validation|error|Error" \
        | sed -u "s/^/[$precision] /"
    local status=${PIPESTATUS[0]}
    set -e
    [[ $status -eq 0 ]] || { echo "$precision run failed (exit $status): see $RUN_DIR/$precision.log"; return 1; }
}

if [[ $PARALLEL == 1 ]]; then
    # Every variant at once on the same GPU: a 125M model leaves most of an H100/H200 idle (launch-bound),
    # so together they finish far sooner than one after another. Losses do not depend on it; step times do.
    pids=()
    for precision in "${RUNS[@]}"; do train_variant "$precision" "$@" & pids+=($!); sleep 2; done
    failed=0; for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    [[ $failed -eq 0 ]] || exit 1
else
    for precision in "${RUNS[@]}"; do train_variant "$precision" "$@" || exit 1; done
fi

logs=(); for v in "${RUNS[@]}"; do logs+=("$RUN_DIR/$v.jsonl"); done
"$PYTHON" scripts/plot_loss.py "${logs[@]}" --labels "${RUNS[@]}" \
    --output "$RUN_DIR/loss_parity.png" --title "125M Llama-style model: INT8 vs BF16" --summary "$RUN_DIR/summary.md"
cat "$RUN_DIR/summary.md"
if [[ -n "${OUT:-}" ]]; then cp "${logs[@]}" "$RUN_DIR"/{loss_parity.png,summary.md} "$OUT"/; fi
