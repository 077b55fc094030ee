#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels a GPU machine without one needs to
# run kvtier's GPU checks (scripts/gpu-check.sh): lmdb, zstandard and xxhash, for each
# CPython version given (default 3.11, 3.12 and 3.13, about 20 MB: whichever the GPU
# machine has; torch, numpy and pytest are expected there already). They land in
# .gpu-wheels/ (gitignored), from which gpu-check.sh installs those that fit its Python.
#
#   scripts/gpu-wheels.sh            # CPython 3.11, 3.12 and 3.13, x86_64
#   scripts/gpu-wheels.sh 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
if (( $# )); then versions=("$@"); else versions=(3.11 3.12 3.13); fi
python="${PYTHON:-.venv/bin/python}"
[[ -x "$python" ]] || python=python3
mkdir -p .gpu-wheels
for py_version in "${versions[@]}"; do
  "$python" -m pip download --quiet --only-binary=:all: --no-deps \
    --python-version "$py_version" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .gpu-wheels "lmdb>=1.4" "zstandard>=0.22" "xxhash>=3.4"
done
ls -1 .gpu-wheels
