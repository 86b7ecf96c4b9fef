#!/usr/bin/env bash
# Install megatron-int8 with its test extra into the Python that `python3` runs (an activated venv included),
# with the newest megatron-core that Python takes within the supported 0.16.1-0.19.x: 0.19.x on Python >= 3.12
# (megatron-core 0.17 and later publish 3.12 wheels only), 0.16.1 on Python 3.10-3.11.
# torch: an installed one is kept (CUDA builds included). Where torch is missing, Python 3.11 gets torch==2.13.0
# (a local CPU wheel on the project's CI machines) and Python >= 3.12 pip's newest torch (2.15.0 as of 2026-12,
# a CUDA build from the package index; where a pip constraint caps torch, the cap's release).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch" 2>/dev/null; then
  if python3 -c "import sys; sys.exit(sys.version_info < (3, 12))"; then
    python3 -m pip install -q torch
  else
    python3 -m pip install -q torch==2.13.0
  fi
fi
python3 -m pip install -q -e ".[test]"
# the installed distribution's version: megatron.core.__version__ appends the git commit of the current folder
PYTHONWARNINGS=ignore python3 - <<'EOF'
import importlib.metadata, sys
import megatron.core, megatron_int8, torch
print(f"megatron-int8 {megatron_int8.__version__}, megatron-core {importlib.metadata.version('megatron-core')}, "
      f"torch {torch.__version__}, Python {sys.version.split()[0]}")
EOF
