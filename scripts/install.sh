#!/usr/bin/env bash
# Install megatron-int8 with its test extra. Keeps an existing torch (CUDA builds included);
# installs torch==2.13.0 only where torch is missing (a local CPU wheel on the project's CI machines).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test]"
python3 -c "import megatron_int8, megatron.core, torch; print(f'megatron-int8 {megatron_int8.__version__}, megatron-core {megatron.core.__version__}, torch {torch.__version__}')"
