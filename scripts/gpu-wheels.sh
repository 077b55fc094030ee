#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels a GPU machine without one needs to
# run kvtier's GPU checks (scripts/gpu-check.sh): lmdb, zstandard and xxhash for its Python
# (default 3.12; torch, numpy and pytest are expected there already). They land in
# .gpu-wheels/ (gitignored), which is what gpu-check.sh installs from.
#
#   scripts/gpu-wheels.sh            # CPython 3.12, x86_64
#   scripts/gpu-wheels.sh 3.11
set -euo pipefail
cd "$(dirname "$0")/.."
py_version="${1:-3.12}"
python="${PYTHON:-.venv/bin/python}"
[[ -x "$python" ]] || python=python3
mkdir -p .gpu-wheels
"$python" -m pip download --quiet --only-binary=:all: --no-deps \
  --python-version "$py_version" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .gpu-wheels "lmdb>=1.4" "zstandard>=0.22" "xxhash>=3.4"
ls -1 .gpu-wheels
