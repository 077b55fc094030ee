#!/usr/bin/env bash
# Install LMCache 0.5.6 into its OWN virtual environment (.venv-lmcache, gitignored), for
# the side-by-side comparison in benchmarks/storage_bench.py. Never touches .venv.
#
# Order matters: the CPU build of torch first, so that pip keeps it when it resolves
# lmcache's unpinned `torch` requirement (otherwise it pulls the multi-GB CUDA build).
# About 2-3 minutes, about 1.9 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LMCACHE_VENV:-.venv-lmcache}
PY=${PYTHON:-python3}
if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import lmcache" >/dev/null 2>&1; then
  echo "[setup_lmcache] $VENV already has lmcache" >&2
  exit 0
fi
echo "[setup_lmcache] building $VENV" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# (this machine's pip config names local wheel folders that may be absent: hide those warnings)
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" \
          2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip install --upgrade pip
pip install "torch==2.13.0"   # the +cpu build on these machines (as in scripts/dev-env.sh)
pip install "lmcache==0.5.6"
"$VENV/bin/python" -c "import lmcache, torch; print('[setup_lmcache] lmcache OK, torch', torch.__version__)"
