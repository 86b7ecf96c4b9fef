#!/usr/bin/env bash
# Issue #48's journey on a GPU machine: train the tiny model briefly, interrupt-free resume, evaluate,
# generate (INT8 and BF16 linears, KV cache on the GPU), export to Hugging Face and load the export in the
# machine's transformers on the GPU. Run from the repository root after `pip install -e .`:
#
#     bash scripts/gpu_journey_check.sh            # RUN_DIR=runs/journey by default
#
# The CPU tests (tests/test_journey.py) are the main evidence; this checks the same steps with CUDA, bf16
# and the Triton INT8 kernels, and the export against the GPU machine's transformers version.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/journey}
PYTHON=${PYTHON:-python3}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
rm -rf "$RUN_DIR/checkpoints" "$RUN_DIR/hf" "$RUN_DIR/train_log.jsonl"*
RUN_DIR="$RUN_DIR" bash scripts/run_tiny.sh --train-iters 40 --save-interval 20
RUN_DIR="$RUN_DIR" bash scripts/run_tiny.sh --train-iters 60 --save-interval 20 | grep "loaded checkpoint"
"$PYTHON" -m megatron_int8.pretrain --config configs/tiny.yaml --int8-linear --bf16 --split 98,2,0 \
    --data-path "$RUN_DIR/data/stdlib_text_document" --tokenizer-model "$RUN_DIR/tokenizer/spm.model" \
    --data-cache-path "$RUN_DIR/data/cache" --load "$RUN_DIR/checkpoints" --skip-train --eval-iters 4 | grep "loss at"
"$PYTHON" scripts/generate.py --load "$RUN_DIR/checkpoints" --prompt "def main(" --max-new-tokens 40 --bf16
"$PYTHON" scripts/generate.py --load "$RUN_DIR/checkpoints" --prompt "import " --max-new-tokens 40 --bf16 \
    --bf16-linears --temperature 0.8 --top-p 0.9
"$PYTHON" scripts/export_hf.py --load "$RUN_DIR/checkpoints" --output "$RUN_DIR/hf"
"$PYTHON" - "$RUN_DIR" <<'PY'
import sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
path = f"{sys.argv[1]}/hf"
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
inputs = tokenizer("def main(", return_tensors="pt", add_special_tokens=False).to("cuda")
out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
print(f"transformers {transformers.__version__}: {type(model).__name__} on {torch.cuda.get_device_name()}:")
print(tokenizer.decode(out[0]))
PY
echo "journey check done: $RUN_DIR"
