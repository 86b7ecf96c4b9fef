#!/usr/bin/env bash
# Issue #51: INT8 vs BF16 convergence of a ~350M-parameter Llama-style model (configs/convergence_350m.yaml,
# 344.0M parameters) over 2300 iterations x 64 x 2048 = 301.5M tokens per precision, both at once on one
# 4-GPU machine (nvidia-h100-x4 or nvidia-h200-x4): BF16 on GPUs 0,1 and INT8 (default recipe,
# --int8-stats-interval 100 --int8-auto-fallback) on GPUs 2,3, each with torchrun --nproc-per-node 2 (data
# parallel), same seed, so the same initialization, data order and validation batches.
#
# The noise floor: SECOND=bf16_init2 runs, in INT8's place, BF16 from another initialization (--seed + 1) on the
# same batches (--data-seed), and the same report compares it with BF16: how far two BF16 runs drift apart is the
# scale the INT8 gap is judged against. In a RUN_DIR where the BF16 run has finished, `start` runs only the new one,
# and a later report of the INT8 pair (SECOND=int8) in that RUN_DIR shows the noise floor's gap beside INT8's.
#
# On a 2-GPU machine, GPUS_PER_RUN=1 runs each precision on one GPU (BF16 on 0, the other on 1; the same global
# batch, by gradient accumulation), at about half the speed: on two H200s (2026-11-28, c1db005) BF16 ran 181k and
# INT8 209k tokens/s, so 301.5M tokens take 28 and 24 minutes of steps, more than one 30-minute machine loan.
# On a 1-GPU machine, REFERENCE_PAIR="<pair>" runs only the run beside BF16 (SECOND), on GPU 0, and compares its
# validation losses with those of a pair an earlier job recorded in benchmarks/results/convergence_350m.csv (the
# `pair` column), e.g. SECOND=int8_attention (INT8 with --int8-attention) against the BF16 and INT8 runs of a 2-GPU
# job. The comparison holds only on that job's token stream (TOKENS_SHA256=<its SHA-256, or a prefix> makes the
# data build stop before the launch where the stream built here differs: another corpus or tokenizer) and with the
# same validation batches: pairs recorded before 70dc00f (2026-12-01) were scored on others (docs/convergence.md,
# section 10), so a run of today's trainer is compared with the validation losses of a pair recorded since.
# The mirror of that: RECORDED_LOG=<the JSONL log of SECOND's run from an earlier job, .jsonl or .jsonl.gz> runs only
# BF16, on GPU 0, and the report compares the two as a pair (training loss, validation at every evaluation, gradient
# norms, spikes), e.g. BF16 beside benchmarks/results/convergence_350m_logs/int8_attention_*.jsonl.gz. It holds with
# the recorded run's token stream (TOKENS_SHA256), TRAIN_ITERS and EXTRA_FLAGS (docs/convergence.md gives them for
# each kept log; the report names a pair whose learning rates differ at any step); the throughput ratio of two jobs
# is labelled.
# RECORDED_BF16_LOG=<BF16's log from an earlier job> is the other way round: SECOND runs alone, on GPU 0, and the
# report is the same two-run report (e.g. INT8 beside benchmarks/results/convergence_350m_logs/bf16_*.jsonl.gz, or
# SECOND=bf16_init2 for the noise floor beside it). Each recorded log must be of the precision it stands in for (its
# records' "int8" flag), or `start` refuses it.
# STOP_AT=<iteration> stops both runs there on the full schedule (the learning rate follows TRAIN_ITERS), with a
# checkpoint; a later `STOP_AT=<later> bash scripts/convergence_4gpu.sh start` on the same disk continues them.
#
# On a machine of your own: `bash scripts/convergence_4gpu.sh start`, then `bash scripts/convergence_4gpu.sh
# status 3600` to follow it (repo root; megatron-core installed, or its wheel in .whl/ as in
# benchmarks/gpu_*_check.sh). On a machine lent in commands of at most 10 minutes, as this project's GPU
# machines are:
#   call 1:           bash scripts/convergence_4gpu.sh start && bash scripts/convergence_4gpu.sh status 540
#   following calls:  bash scripts/convergence_4gpu.sh status 560
# and send each next call at once: such a machine goes back after 30 s idle and takes the data and checkpoints
# with it (a fresh machine starts everything over). The runs are detached (setsid), so
# they go on between calls; every `status` call writes to $OUT what there is so far. Such a machine is held 30
# minutes at most: its start, the data build (1.5 minutes on 4 H100s) and both runs must fit in it. Each
# status line gives the minutes of steps left; if call 1 shows more than ~20, both runs will not finish in time
# (TRAIN_ITERS, set at the first `start`, shortens the schedule; below 2289 iterations the runs see fewer than
# 300M tokens).
#
# Both runs replay CUDA graphs (--cuda-graph-impl local; GRAPHS=none turns them off). At this width a step
# is bound by kernel launches: eager, on 4 H100s (2026-11-27, 57ce0e5), BF16 ran 305k and INT8 228k tokens/s per
# pair of GPUs, so INT8 needed ~22 minutes of steps and did not finish in one machine loan. Graphed, on 4 H100s
# (2026-11-28, 4e3d701), BF16 ran 339k and INT8 378k tokens/s per pair: 14.9 and 14.1 minutes of steps, both runs
# finished 18 minutes after call 1 began; on 4 H200s (2026-11-28, d4525ef) 351k and 409k, finished after 19.
#
# start     builds the data once, in the background: the corpus is every .py source and .rst/.md
#           documentation file of the machine's Python (standard library, then site-packages), up to
#           CORPUS_MB (1024) MB (scripts/prepare_tiny_corpus.py --source all --docs); one SentencePiece
#           tokenizer of VOCAB (8192) tokens (or TOKENIZER, a model file to reuse) and the indexed dataset
#           (scripts/preprocess_data.py), split 98/2/0 by documents (the last 2% held out for validation);
#           then launches both runs. Each run
#           resumes from its checkpoint directory when one exists (--load = --save), so `start` after a run
#           died continues it, and a run that is alive or finished is left alone.
# status [S] waits up to S seconds (default 0) while printing each run's progress (iteration, loss, last
#           validation loss, tokens/s, steps left) every 30 s, and copies to $OUT: bf16.jsonl, int8.jsonl,
#           corpus.json, logs.tar.gz (the runs' and the data build's output, and tokenizer/spm.model), and
#           the report of scripts/convergence_report.py (convergence.png, convergence.md, health.png) over what
#           the runs logged so far. It returns early when both runs have finished (or stopped at STOP_AT) or one
#           failed (exit 1).
#
# The corpus statistics (scripts/convergence_report.py corpus -> corpus.json, printed by the data build, by
# every `status` and in convergence.md): corpus bytes = UTF-8 bytes of the files' text; tokens = the indexed
# dataset's document lengths (with one end-of-document token each), split as megatron's GPTDataset splits the
# documents (train = the first 98%); distinct token ids = vocabulary entries that occur; epochs = tokens the run
# trains on (train_iters x global batch x sequence length) / tokens of the training split.
# Corpus size: what the GPU machine's Python holds, measured at run time. On the CPU machine of 2026-11-27
# (Python 3.11 and its packages) the same selection was 222.7 MB in 21255 files (214.9 MB .py, 7.8 MB .rst/.md);
# the GPU image has more packages (jax, transformers, scipy, ...). At the parity corpus's ~0.32 tokens per byte
# (8192-token vocabulary: 25M training tokens from 80 MB, docs/convergence.md), 301.5M tokens are one epoch of
# ~900 MB: expect 1.5-4 epochs.
#
# Environment: RUN_DIR (runs/convergence), CONFIG (configs/convergence_350m.yaml), CORPUS_MB (1024), VOCAB
# (8192), WORKERS (nproc), TRAIN_ITERS (the YAML's unless set; the first `start` keeps it in RUN_DIR/train_iters
# for later calls), SAVE_INTERVAL (the YAML's unless set),
# TOKENIZER (a SentencePiece model to use instead of training one; with the corpus's SHA-256 unchanged, a tokenizer
# from an earlier run's logs.tar.gz gives that run's token stream. Training is reproducible since acee284: before,
# SentencePiece's own line sampler drew another sample in every process, and three runs of 2026-11-27/28 got
# 97.90M-97.95M tokens from the same text),
# EXTRA_FLAGS (more trainer flags for both runs), INT8_FLAGS (more for the INT8 run; both kept in RUN_DIR by the
# first `start`, so that a run launched later trains with its partner's flags), PYTHON (python3), MIN_GPUS
# (the runs x GPUS_PER_RUN; 0 lets `start` run the plumbing on a CPU with a small model, e.g. CONFIG=configs/tiny.yaml
# GRAPHS=none),
# GRAPHS (local: CUDA graphs, or none), SECOND (int8, int8_attention, or bf16_init2: the run beside BF16; the first
# `start` keeps it in RUN_DIR/second), GPUS_PER_RUN (2; 1 on a 2-GPU machine), STOP_AT (TRAIN_ITERS: the iteration
# where both runs stop; each `start` keeps GPUS_PER_RUN and STOP_AT in RUN_DIR for later calls), PORT_BASE (29511:
# the BF16 run's rendezvous port, the other run's the next; another pair where two pipelines share a machine),
# REFERENCE_PAIR (none: the recorded pair a lone SECOND run is compared with, kept in RUN_DIR), REFERENCE_CSV
# (benchmarks/results/convergence_350m.csv: where that pair is recorded), RECORDED_LOG (none: SECOND's log from an
# earlier job, beside which a lone BF16 run trains; kept in RUN_DIR), RECORDED_BF16_LOG (none: BF16's log from an
# earlier job, beside which a lone SECOND run trains; kept in RUN_DIR), TOKENS_SHA256 (none: the token stream's
# SHA-256, or a prefix, the data build must give before a launch), POLL_S (30: seconds between two looks of a
# waiting `status`).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/convergence}
CONFIG=${CONFIG:-configs/convergence_350m.yaml}
PYTHON=${PYTHON:-python3}
CORPUS_MB=${CORPUS_MB:-1024}
VOCAB=${VOCAB:-8192}
POLL_S=${POLL_S:-30}
[[ $POLL_S =~ ^[1-9][0-9]*$ ]] || { echo "error: POLL_S is a whole number of seconds >= 1, got '$POLL_S'" >&2; exit 2; }
WORKERS=${WORKERS:-$(nproc)}
PREFIX="$RUN_DIR/data/corpus"
DATA="${PREFIX}_text_document"
# the run beside BF16: int8, int8_attention (with --int8-attention), or bf16_init2 for the noise floor (kept in
# RUN_DIR/second by the first `start`)
SECOND=${SECOND:-$(cat "$RUN_DIR/second" 2>/dev/null || echo int8)}
[[ $SECOND == int8 || $SECOND == int8_attention || $SECOND == bf16_init2 ]] ||
    { echo "error: SECOND is int8, int8_attention or bf16_init2, got '$SECOND'" >&2; exit 2; }
# a pair recorded by an earlier job, compared with in place of a BF16 run here (kept in RUN_DIR/reference_pair;
# REFERENCE_PAIR= set empty forgets it, so that a later `start` runs BF16 beside the lone run of this RUN_DIR)
REFERENCE_PAIR=${REFERENCE_PAIR-$(cat "$RUN_DIR/reference_pair" 2>/dev/null || true)}
REFERENCE_CSV=${REFERENCE_CSV:-benchmarks/results/convergence_350m.csv}
# SECOND's log from an earlier job, beside which BF16 runs alone here (kept in RUN_DIR/recorded_log)
RECORDED_LOG=${RECORDED_LOG-$(cat "$RUN_DIR/recorded_log" 2>/dev/null || true)}
# BF16's log from an earlier job, beside which SECOND runs alone here (kept in RUN_DIR/recorded_bf16_log)
RECORDED_BF16_LOG=${RECORDED_BF16_LOG-$(cat "$RUN_DIR/recorded_bf16_log" 2>/dev/null || true)}
(( (${#REFERENCE_PAIR} > 0) + (${#RECORDED_LOG} > 0) + (${#RECORDED_BF16_LOG} > 0) <= 1 )) ||
    { echo "error: REFERENCE_PAIR and RECORDED_BF16_LOG run SECOND alone, RECORDED_LOG runs BF16 alone: give one of" \
        "them" >&2; exit 2; }
if [[ -n $REFERENCE_PAIR ]]; then
    [[ $SECOND != bf16_init2 ]] || { echo "error: REFERENCE_PAIR compares an INT8 run, not SECOND=bf16_init2" >&2; exit 2; }
    grep -qF ",$REFERENCE_PAIR," "$REFERENCE_CSV" 2>/dev/null ||
        { echo "error: no pair '$REFERENCE_PAIR' in $REFERENCE_CSV (REFERENCE_PAIR is its pair column)" >&2; exit 2; }
    RUNS=("$SECOND")
elif [[ -n $RECORDED_LOG ]]; then
    RUNS=(bf16)
elif [[ -n $RECORDED_BF16_LOG ]]; then
    RUNS=("$SECOND")
else
    RUNS=(bf16 "$SECOND")
fi
# GPUs per run (kept in RUN_DIR/gpus_per_run by `start`): 2 on a 4-GPU machine, 1 on a 2-GPU one
GPUS_PER_RUN=${GPUS_PER_RUN:-$(cat "$RUN_DIR/gpus_per_run" 2>/dev/null || echo 2)}
[[ $GPUS_PER_RUN =~ ^[1-9][0-9]*$ ]] || { echo "error: GPUS_PER_RUN is a positive number, got '$GPUS_PER_RUN'" >&2; exit 2; }
gpu_list() { seq -s, "$1" $(($1 + GPUS_PER_RUN - 1)); }  # gpu_list FIRST: FIRST,...,FIRST+GPUS_PER_RUN-1
PORT_BASE=${PORT_BASE:-29511}
[[ $PORT_BASE =~ ^[1-9][0-9]*$ && $PORT_BASE -lt 65535 ]] || { echo "error: PORT_BASE is a port below 65535, got '$PORT_BASE'" >&2; exit 2; }
declare -A GPUS=([bf16]=$(gpu_list 0) [$SECOND]=$(gpu_list $((GPUS_PER_RUN * (${#RUNS[@]} - 1)))))
declare -A PORT=([bf16]=$PORT_BASE [$SECOND]=$((PORT_BASE + 1)))
declare -A LABEL=([bf16]=BF16 [int8]=INT8 [int8_attention]="INT8 + INT8 attention" [bf16_init2]="BF16, init seed 2")
THE_RUNS=$([[ ${#RUNS[@]} -eq 1 ]] && echo "the run" || echo "both runs")
SEED=$(awk '/^seed:/ {print $2}' "$CONFIG" 2>/dev/null)
SEED=${SEED:-1234}
TRAIN_ITERS=${TRAIN_ITERS:-$(cat "$RUN_DIR/train_iters" 2>/dev/null || awk '/^train_iters:/ {print $2}' "$CONFIG")}
# where both runs stop (a checkpoint; `STOP_AT=<later> ... start` continues them) on the schedule of TRAIN_ITERS
STOP_AT=${STOP_AT:-$(cat "$RUN_DIR/stop_at" 2>/dev/null || echo "$TRAIN_ITERS")}
[[ $STOP_AT =~ ^[1-9][0-9]*$ && $STOP_AT -le $TRAIN_ITERS ]] ||
    { echo "error: STOP_AT is an iteration in 1..$TRAIN_ITERS (TRAIN_ITERS), got '$STOP_AT'" >&2; exit 2; }
REPORT=(scripts/convergence_report.py)
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
# NVLink multicast stays off on the lent machines (NCCL, PyTorch symmetric memory, NVSHMEM)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

die() { echo "error: $*" >&2; exit 1; }
alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
checkpointed() { cat "$RUN_DIR/$1/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0; }
finished() { [[ "$(checkpointed "$1")" -ge $TRAIN_ITERS ]]; }
stopped() { [[ "$(checkpointed "$1")" -ge $STOP_AT ]]; }  # reached STOP_AT (before TRAIN_ITERS) and saved

python_path() {  # megatron-core from the carried wheels where the machine's Python lacks it (/tmp/site stays)
    if [[ -d /tmp/site/megatron ]]; then export PYTHONPATH=/tmp/site:$PWD; return; fi
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
    "$PYTHON" -c "import megatron.core" 2>/dev/null && return
    ls .whl/*.whl > /dev/null 2>&1 || die "megatron-core is not installed and no .whl/ was carried (carry: [\".whl\"])"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
}

build_data() {  # each step ends the function on failure (errexit does not hold in `build_data || ...`)
    local settings="CORPUS_MB=$CORPUS_MB VOCAB=$VOCAB"
    if [[ -f "$RUN_DIR/data.settings" && "$(cat "$RUN_DIR/data.settings")" != "$settings" ]]; then
        echo "error: $RUN_DIR holds data built with $(cat "$RUN_DIR/data.settings"), not $settings: give another" \
            "RUN_DIR (or those settings)" >&2
        return 1
    fi
    if [[ ! -f "$RUN_DIR/corpus.jsonl" ]]; then
        echo "== corpus: .py sources and .rst/.md docs of the standard library and site-packages (up to $CORPUS_MB MB)"
        "$PYTHON" scripts/prepare_tiny_corpus.py --source all --docs --output "$RUN_DIR/corpus.jsonl" \
            --max-mb "$CORPUS_MB" || return 1
    fi
    if [[ ! -f "$DATA.bin" ]]; then  # preprocess_data.py renames the .bin into place only when complete
        local train=(--train-sentencepiece "$VOCAB" --force)  # a tokenizer left by an interrupted run: made again
        if [[ -n "${TOKENIZER:-}" ]]; then  # another run's tokenizer: its token stream, where the corpus is the same
            mkdir -p "$RUN_DIR/tokenizer" && cp "$TOKENIZER" "$RUN_DIR/tokenizer/spm.model" || return 1
            train=()
        fi
        echo "== ${train[*]:+SentencePiece ($VOCAB tokens) + }indexed dataset, $WORKERS workers"
        "$PYTHON" scripts/preprocess_data.py --input "$RUN_DIR/corpus.jsonl" --json-keys text --output-prefix "$PREFIX" \
            --tokenizer-type SentencePieceTokenizer --tokenizer-model "$RUN_DIR/tokenizer/spm.model" \
            "${train[@]}" --workers "$WORKERS" --log-interval-s 15 || return 1
    fi
    [[ -f "$RUN_DIR/data.settings" ]] || echo "$settings" > "$RUN_DIR/data.settings"
    if [[ -n "${TOKENS_SHA256:-}" ]]; then  # the reference's token stream, or nothing is launched
        local built
        built=$(sha256sum "$DATA.bin" | cut -d' ' -f1)
        [[ $built == "$TOKENS_SHA256"* ]] || { echo "error: the token stream built here has SHA-256 $built, not" \
            "$TOKENS_SHA256 (TOKENS_SHA256): another corpus or tokenizer than the reference's; nothing launched"; return 1; }
        echo "== token stream: SHA-256 $built, as TOKENS_SHA256"
    fi
}

corpus_statistics() {  # after the launch: the runs need not wait for it
    [[ -f "$RUN_DIR/corpus.json" ]] && return
    "$PYTHON" "${REPORT[@]}" corpus --corpus "$RUN_DIR/corpus.jsonl" --prefix "$DATA" --config "$CONFIG" \
        --train-iters "$TRAIN_ITERS" --vocab-size "$VOCAB" --tokenizer-model "$RUN_DIR/tokenizer/spm.model" \
        --output "$RUN_DIR/corpus.json"
}

launch() {  # launch NAME: one precision on its GPUs, detached (setsid); NAME.pid, NAME.rc, NAME.log
    local name=$1 flags=()
    read -r -a flags <<< "${EXTRA_FLAGS:-}"
    if [[ $name == int8 || $name == int8_attention ]]; then
        local int8_extra=()
        read -r -a int8_extra <<< "${INT8_FLAGS:-}"
        flags+=(--int8-linear --int8-stats-interval 100 --int8-auto-fallback "${int8_extra[@]}")
        [[ $name == int8_attention ]] && flags+=(--int8-attention)
    elif [[ $name == bf16_init2 ]]; then  # BF16's batches from another initialization
        flags+=(--seed $((SEED + 1)) --data-seed "$SEED")
    fi
    [[ -n "${SAVE_INTERVAL:-}" ]] && flags+=(--save-interval "$SAVE_INTERVAL")
    [[ $STOP_AT -lt $TRAIN_ITERS ]] && flags+=(--exit-interval "$STOP_AT")  # saves a checkpoint there and exits
    flags+=(--cuda-graph-impl "${GRAPHS:-local}")
    mkdir -p "$RUN_DIR/$name/ckpt"
    rm -f "$RUN_DIR/$name.rc"
    echo "== launching $name on GPUs ${GPUS[$name]}: ${flags[*]}"
    setsid bash -c 'echo $$ > "$1"; rc=$2; shift 2; "$@"; echo $? > "$rc"' _ "$RUN_DIR/$name.pid" "$RUN_DIR/$name.rc" \
        env CUDA_VISIBLE_DEVICES="${GPUS[$name]}" "$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_RUN" \
        --master-port "${PORT[$name]}" -m megatron_int8.pretrain --config "$CONFIG" --train-iters "$TRAIN_ITERS" \
        --data-path "$DATA" --tokenizer-model "$RUN_DIR/tokenizer/spm.model" --data-cache-path "$RUN_DIR/data/cache_$name" \
        --save "$RUN_DIR/$name/ckpt" --load "$RUN_DIR/$name/ckpt" --most-recent-k 1 --exit-signal-handler \
        --log-jsonl "$RUN_DIR/$name.jsonl" "${flags[@]}" >> "$RUN_DIR/$name.log" 2>&1 < /dev/null &
}

pipeline() {  # the data, the runs, the corpus statistics (what `start` leaves running in the background)
    local status=0
    build_data || status=$?
    if [[ $status -eq 0 ]]; then
        for name in "${RUNS[@]}"; do
            if finished "$name"; then echo "== $name: finished ($TRAIN_ITERS iterations)"
            elif stopped "$name"; then echo "== $name: stopped at iteration $(checkpointed "$name") (STOP_AT $STOP_AT)"
            elif alive "$RUN_DIR/$name.pid"; then echo "== $name: running"
            else launch "$name"; fi
        done
        corpus_statistics || echo "warning: the corpus statistics failed (above); the runs go on"
    fi
    echo "$status" > "$RUN_DIR/pipeline.rc"
}

keep_flags() {  # keep_flags VAR FILE: VAR as the first `start` gave it, kept in RUN_DIR/FILE for the later calls
    local var=$1 file="$RUN_DIR/$2" name
    if [[ -f $file && -z ${!var+set} ]]; then
        export "$var=$(cat "$file")"
    elif [[ -f $file && "${!var}" != "$(cat "$file")" ]]; then
        for name in "${RUNS[@]}"; do
            [[ -f "$RUN_DIR/$name.jsonl" ]] && die "$var='${!var}' differs from '$(cat "$file")', which the runs of" \
                "$RUN_DIR started with: a run launched now would train with other flags than its partner; leave $var" \
                "unset to keep them, or use another RUN_DIR"
        done
    fi
    printf '%s\n' "${!var:-}" > "$file"
}

check_recorded() {  # check_recorded VAR PARTNER: the partner's log from an earlier job exists and is of its precision
    local var=$1 partner=$2 log=${!1} precision expected=INT8
    [[ -f $log ]] || die "$var: no file '$log'"
    [[ ! -d "$RUN_DIR/$partner/ckpt" ]] ||
        die "$RUN_DIR holds a $partner run of its own: use another RUN_DIR for a ${LABEL[${RUNS[0]}]} run beside $var"
    precision=$("$PYTHON" -c 'import gzip, json, sys
path = sys.argv[1]
for line in (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8"):
    record = json.loads(line) if line.strip() else {}
    if "int8" in record:
        print("INT8" if record["int8"] else "BF16")
        break' "$log") || die "$var: '$log' is not a trainer's JSONL log"
    [[ $partner == bf16* ]] && expected=BF16
    if [[ $precision != "$expected" ]]; then
        local what="the log of a $precision run"
        [[ -n $precision ]] || what='no training run'"'"'s log (no "int8" record)'
        die "$var: '$log' is $what, not of $partner (RECORDED_LOG is SECOND's log, RECORDED_BF16_LOG BF16's)"
    fi
}

place_recorded() {  # place_recorded VAR PARTNER: the checked log where the report reads it
    local var=$1 partner=$2
    case ${!var} in *.gz) gzip -dc ;; *) cat ;; esac < "${!var}" > "$RUN_DIR/$partner.jsonl" ||
        die "$var: cannot read '${!var}'"
}

start() {
    mkdir -p "$RUN_DIR"
    keep_flags EXTRA_FLAGS extra_flags
    keep_flags INT8_FLAGS int8_flags
    # a recorded log is checked before anything imports torch: a wrong one is named in a moment
    if [[ -n $RECORDED_LOG ]]; then check_recorded RECORDED_LOG "$SECOND"; fi
    if [[ -n $RECORDED_BF16_LOG ]]; then check_recorded RECORDED_BF16_LOG bf16; fi
    python_path
    local gpus name
    gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
    local needed=$((${#RUNS[@]} * GPUS_PER_RUN))
    [[ $gpus -ge ${MIN_GPUS:-$needed} ]] ||
        die "this needs $needed GPUs ($(for name in "${RUNS[@]}"; do printf '%s on %s; ' "$name" "${GPUS[$name]}"; done)" \
            "torch sees $gpus) (GPUS_PER_RUN=1 runs each precision on one GPU of a 2-GPU machine)"
    if alive "$RUN_DIR/pipeline.pid"; then echo "the data build is running: see $RUN_DIR/pipeline.log"; return; fi
    if [[ -f "$RUN_DIR/train_iters" && "$TRAIN_ITERS" != "$(cat "$RUN_DIR/train_iters")" ]]; then
        for name in "${RUNS[@]}"; do
            [[ -f "$RUN_DIR/$name.jsonl" ]] && die "TRAIN_ITERS=$TRAIN_ITERS differs from $(cat "$RUN_DIR/train_iters")," \
                "which the runs of $RUN_DIR started with: a run launched now would follow another schedule than its" \
                "partner; leave TRAIN_ITERS unset to keep it, or use another RUN_DIR"
        done
    fi
    echo "$TRAIN_ITERS" > "$RUN_DIR/train_iters"  # what every later call compares the runs with
    echo "$STOP_AT" > "$RUN_DIR/stop_at"
    echo "$GPUS_PER_RUN" > "$RUN_DIR/gpus_per_run"
    echo "$SECOND" > "$RUN_DIR/second"
    echo "$REFERENCE_PAIR" > "$RUN_DIR/reference_pair"
    if [[ -n $RECORDED_LOG ]]; then place_recorded RECORDED_LOG "$SECOND"; fi
    if [[ -n $RECORDED_BF16_LOG ]]; then place_recorded RECORDED_BF16_LOG bf16; fi
    echo "$RECORDED_LOG" > "$RUN_DIR/recorded_log"
    echo "$RECORDED_BF16_LOG" > "$RUN_DIR/recorded_bf16_log"
    rm -f "$RUN_DIR/pipeline.rc"  # the last attempt's outcomes, so that `status` does not read them as this one's
    for name in "${RUNS[@]}"; do alive "$RUN_DIR/$name.pid" || rm -f "$RUN_DIR/$name.rc"; done
    # setsid execs (a background job of a script is no process-group leader), so $! is the pipeline's shell
    setsid bash "$PWD/scripts/convergence_4gpu.sh" _pipeline >> "$RUN_DIR/pipeline.log" 2>&1 < /dev/null &
    echo $! > "$RUN_DIR/pipeline.pid"
    echo "started in the background (log: $RUN_DIR/pipeline.log); follow with: bash scripts/convergence_4gpu.sh status 540"
}

state_of() {  # state_of NAME: finished / stopped at N / running / failed (exit N) / not started
    local name=$1
    if finished "$name"; then echo finished
    elif stopped "$name"; then echo "stopped at $(checkpointed "$name")"
    elif alive "$RUN_DIR/$name.pid"; then echo running
    elif [[ -f "$RUN_DIR/$name.rc" ]]; then echo "failed (exit $(cat "$RUN_DIR/$name.rc"))"
    else echo "not started"; fi
}

show_progress() {
    echo "-- $(date -u +%H:%M:%S)"
    if alive "$RUN_DIR/pipeline.pid"; then
        echo "pipeline: $(grep -v '^\s*$' "$RUN_DIR/pipeline.log" | tail -n 1)"
    elif [[ "$(cat "$RUN_DIR/pipeline.rc" 2>/dev/null)" != 0 ]]; then
        echo "data build failed or stopped: the end of $RUN_DIR/pipeline.log:"; tail -n 15 "$RUN_DIR/pipeline.log"
    fi
    for name in "${RUNS[@]}"; do
        echo "$name [$(state_of "$name")]: $("$PYTHON" "${REPORT[@]}" progress --log "$RUN_DIR/$name.jsonl" \
            --config "$CONFIG" --train-iters "$TRAIN_ITERS" --stop-at "$STOP_AT")"
    done
    if command -v nvidia-smi > /dev/null; then
        echo "GPUs (index, utilization, memory used): $(nvidia-smi --query-gpu=index,utilization.gpu,memory.used \
            --format=csv,noheader 2>/dev/null | paste -sd ';')"
    fi
}

collect() {  # what the runs logged so far, to $OUT (at most 8 files come back: 7 here)
    [[ -n "${OUT:-}" ]] || return 0
    local name path logs=()
    for name in "${RUNS[@]}"; do [[ -f "$RUN_DIR/$name.jsonl" ]] && cp "$RUN_DIR/$name.jsonl" "$OUT/"; done
    [[ -f "$RUN_DIR/corpus.json" ]] && cp "$RUN_DIR/corpus.json" "$OUT/"
    # the trainers' output, and the records a resumed run set aside (its log's .after-<iteration> files)
    for name in pipeline "${RUNS[@]}"; do
        for path in "$RUN_DIR/$name.log" "$RUN_DIR/$name".jsonl.after-*; do
            [[ -f "$path" ]] && logs+=("${path##*/}")
        done
    done
    [[ -f "$RUN_DIR/tokenizer/spm.model" ]] && logs+=(tokenizer/spm.model)  # TOKENIZER= for a run on the same stream
    [[ ${#logs[@]} -gt 0 ]] && tar -czf "$OUT/logs.tar.gz" -C "$RUN_DIR" "${logs[@]}"
    return 0
}

report_against_csv() {  # REFERENCE_PAIR: the one run here against the recorded pair
    [[ -f "$RUN_DIR/$SECOND.jsonl" ]] || { echo "no report yet: the run has logged nothing"; return 0; }
    mkdir -p "$RUN_DIR/report"
    "$PYTHON" "${REPORT[@]}" against-csv --log "$RUN_DIR/$SECOND.jsonl" --csv "$REFERENCE_CSV" \
        --pair "$REFERENCE_PAIR" --label "${LABEL[$SECOND]}" --config "$CONFIG" --train-iters "$TRAIN_ITERS" \
        --output "$RUN_DIR/report/against_reference.md" > "$RUN_DIR/report.log" 2>&1 ||
        { echo "the report failed:"; tail -n 20 "$RUN_DIR/report.log"; return 0; }
    grep -E "^# |^Check|a lead: |^At the end|^Throughput|move\(s\)" "$RUN_DIR/report/against_reference.md" || true
    if [[ -n "${OUT:-}" ]]; then
        cp "$RUN_DIR/report/against_reference.md" "$OUT/"
        [[ -f "$RUN_DIR/report/health.png" ]] && cp "$RUN_DIR/report/health.png" "$OUT/"
    fi
    return 0
}

report() {
    if [[ -n $REFERENCE_PAIR ]]; then report_against_csv; return; fi
    [[ -f "$RUN_DIR/bf16.jsonl" && -f "$RUN_DIR/$SECOND.jsonl" ]] || { echo "no report yet: the runs have logged nothing"; return 0; }
    local noise=()  # a noise-floor run in the same RUN_DIR: its gap goes beside INT8's
    [[ $SECOND == int8 && -f "$RUN_DIR/bf16_init2.jsonl" ]] &&
        noise=(--noise-floor "$RUN_DIR/bf16.jsonl" "$RUN_DIR/bf16_init2.jsonl")
    "$PYTHON" "${REPORT[@]}" report --bf16 "$RUN_DIR/bf16.jsonl" --int8 "$RUN_DIR/$SECOND.jsonl" --config "$CONFIG" \
        --labels BF16 "${LABEL[$SECOND]}" "${noise[@]}" \
        --train-iters "$TRAIN_ITERS" --output-dir "$RUN_DIR/report" --corpus-stats "$RUN_DIR/corpus.json" \
        --gpus-per-run "$GPUS_PER_RUN" ${RECORDED_LOG:+--other-recorded "$RECORDED_LOG"} \
        ${RECORDED_BF16_LOG:+--bf16-recorded "$RECORDED_BF16_LOG"} \
        > "$RUN_DIR/report.log" 2>&1 || { echo "the report failed:"; tail -n 20 "$RUN_DIR/report.log"; return 0; }
    grep -E -e "^- (BF16|INT8)|^Check|^Noise floor|a lead: |^At the end|^The runs have not|spikes without" \
        -e "^[^|]* / BF16: |fallback|move\(s\)|^\*\*Not one schedule" \
        "$RUN_DIR/report/convergence.md" || true
    if [[ -n "${OUT:-}" ]]; then
        cp "$RUN_DIR"/report/convergence.{png,md} "$OUT/"
        [[ -f "$RUN_DIR/report/health.png" ]] && cp "$RUN_DIR/report/health.png" "$OUT/"
    fi
    return 0
}

status() {
    local wait_s=${1:-0} started=$SECONDS
    [[ $wait_s =~ ^[0-9]+$ ]] || die "status takes a number of seconds, got '$wait_s'"
    if [[ ! -f "$RUN_DIR/pipeline.log" ]]; then
        die "nothing started in $RUN_DIR (no pipeline.log): run 'bash scripts/convergence_4gpu.sh start' first"
    fi
    python_path
    local deadline=$((started + wait_s - 45))  # the report and the copies take the rest
    while true; do
        local done=0 failed=0 name
        for name in "${RUNS[@]}"; do
            case "$(state_of "$name")" in finished | stopped*) done=$((done + 1)) ;; failed*) failed=1 ;; esac
        done
        if ! alive "$RUN_DIR/pipeline.pid" && [[ "$(cat "$RUN_DIR/pipeline.rc" 2>/dev/null)" != 0 ]]; then failed=1; fi
        # the states first, then the snapshot: the last snapshot printed is never behind the states that end the wait
        # (the other order could print a run as running and then end the wait on its having stopped since)
        show_progress
        collect
        [[ $done -eq ${#RUNS[@]} || $failed -eq 1 || $SECONDS -ge $deadline ]] && break
        sleep $((deadline - SECONDS < POLL_S ? (deadline - SECONDS > 1 ? deadline - SECONDS : 1) : POLL_S))
    done
    for name in "${RUNS[@]}"; do
        if [[ "$(state_of "$name")" == failed* ]]; then echo "== the end of $RUN_DIR/$name.log:"; tail -n 25 "$RUN_DIR/$name.log"; fi
    done
    report
    collect
    grep -h "^corpus: .* epochs" "$RUN_DIR/pipeline.log" | tail -n 1 || true
    [[ $failed -eq 0 ]] || die "a run or the data build failed (see above); after a fix, 'start' resumes from the checkpoints"
    if [[ $done -eq ${#RUNS[@]} && $STOP_AT -lt $TRAIN_ITERS ]]; then
        echo "$THE_RUNS stopped at iteration $STOP_AT of $TRAIN_ITERS: the report so far is in \$OUT;" \
            "'STOP_AT=$TRAIN_ITERS bash scripts/convergence_4gpu.sh start' continues $THE_RUNS"
    elif [[ $done -eq ${#RUNS[@]} ]]; then
        echo "$THE_RUNS finished: the report ($([[ -n $REFERENCE_PAIR ]] && echo against_reference.md ||
            echo convergence.md), its PNGs) is in \$OUT"
    fi
    return 0
}

case "${1:-}" in
    start) start ;;
    status) status "${2:-0}" ;;
    _pipeline) python_path; pipeline ;;
    *) echo "usage: bash scripts/convergence_4gpu.sh start | status [SECONDS]" >&2; exit 2 ;;
esac
