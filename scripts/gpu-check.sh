#!/usr/bin/env bash
# The GPU checks of kvtier's data path, in one command, on a machine with CUDA and torch
# (vLLM is not needed): the CUDA tests, the worker's data-path benchmark, and the store
# benchmark on that machine's disk at two batch sizes (with the writer pipeline's serial
# baseline). Results go to $OUT (default ./gpu-results): 8 files at most (tests.txt, log.txt,
# and a markdown report and its JSON per benchmark run).
#
#   scripts/gpu-wheels.sh          # first, where a package index is reachable
#   OUT=/some/dir scripts/gpu-check.sh [tests|gpu|writer|store|storage-tests|all]   # default: all
#
# .gpu-wheels/ is gitignored: a tool that copies the working tree to the GPU machine must be
# told to carry it along. Each part has a time limit (tests 300 s, gpu 420 s, writer 180 s per
# backend, store 240 s per
# commit size: STORE_TIMEOUT; storage-tests none), so a hang
# cannot use up a short lease; run the parts as separate commands (`;`, not `&&`).
#
# tests: tests/gpu; gpu: gpu_bench.py (GPU_ARGS: extra flags, e.g. "--contents kv_last
# --chunk-tokens 1024 --chunks 4", or "--contents kv_last --copy-mib 0 8": loads one layer
# per copy beside 8 MiB copies; "--save-copy-mib 0 8" the same for saves; "--trace $OUT": a
# profiler trace per row, about 4 MiB each, and the device's own costs from it); writer:
# hook_host_bench.py --writer for each backend, what the store's writer costs the model's thread on that
# host (the GIL; no device work; into log.txt, no file of its own); store: storage_bench.py on that disk; storage-tests:
# tests/storage with CUDA visible. On an H100 (2026-11-26) tests took 25-40 s and the
# benchmark about 45 s per content layout; store and storage-tests take minutes. With a
# short lease run tests and gpu first, in one command. tests/vllm/test_gpu_check.py runs the
# parts on the CPU (WRITER_ARGS: extra flags for the writer part), so CI finds a broken script.
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:-all}"
out="${OUT:-gpu-results}"
python="${PYTHON:-python3}"

# kvtier's own dependencies, from the carried wheels where the machine lacks them (into a
# folder of their own: the machine's Python environment is left as it is)
if ! "$python" -c "import lmdb, zstandard, xxhash" 2>/dev/null; then
  [[ -d .gpu-wheels ]] || { echo "lmdb/zstandard/xxhash missing and no .gpu-wheels/: run scripts/gpu-wheels.sh first" >&2; exit 2; }
  site="${TMPDIR:-/tmp}/kvtier-gpu-site"
  # (by name: pip takes the wheels that fit this Python, of those carried for several)
  "$python" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" \
    --find-links .gpu-wheels lmdb zstandard xxhash
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
log="$out/log.txt"  # the benchmarks' progress and errors (appended: one file for every part run)
"$python" - <<'PY' | tee -a "$log"
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__,
      "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))
PY

if [[ "$part" == tests || "$part" == all ]]; then
  # tests/gpu skip without CUDA; a failure is reported, and the benchmarks still run
  timeout 300 "$python" -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$out/tests.txt" | tail -5 || true
fi
if [[ "$part" == storage-tests || "$part" == all ]]; then
  # the storage suite with CUDA visible (pinned pool buffers)
  "$python" -m pytest -q -p no:cacheprovider tests/storage -k "not dali" 2>&1 \
    | tee -a "$out/tests.txt" | tail -3 || true
fi
if [[ "$part" == gpu || "$part" == all ]]; then
  rm -rf "${TMPDIR:-/tmp}/kvtier-gpu-bench"  # (a run before this one's stores)
  df -h "${TMPDIR:-/tmp}" >>"$log" 2>&1 || true
  # shellcheck disable=SC2086
  timeout 420 "$python" benchmarks/gpu_bench.py --dir "${TMPDIR:-/tmp}/kvtier-gpu-bench" --json "$out/gpu_bench.json" \
    ${GPU_ARGS:-} 2>>"$log" | tee "$out/gpu_bench.md" || echo "gpu_bench failed or timed out: see $log" >&2
fi
if [[ "$part" == writer || "$part" == all ]]; then
  for backend in files lmdb; do
    # WRITER_ARGS: extra flags, e.g. "--chunks 2 --rounds 1" for a quick check of this script
    # shellcheck disable=SC2086
    timeout 180 "$python" benchmarks/hook_host_bench.py --writer --rounds 3 --backend "$backend" ${WRITER_ARGS:-} 2>&1 | tee -a "$log" \
      || echo "hook_host_bench --writer --backend $backend failed or timed out: see $log" >&2
  done
fi
if [[ "$part" == store || "$part" == all ]]; then
  for mib in 256 128; do
    # STORE_ARGS: extra flags, e.g. "--chunks 4" for a quick check of this script
    # shellcheck disable=SC2086
    timeout "${STORE_TIMEOUT:-240}" "$python" benchmarks/storage_bench.py --backends files lmdb --skip-lookup --no-zstd --repeat 2 \
      --commit-mib "$mib" --json "$out/storage_bench_$mib.json" ${STORE_ARGS:-} 2>>"$log" \
      | tee "$out/storage_bench_$mib.md" | grep -E "^\| kvtier (files|lmdb)/power/(none|serial) |O_DIRECT. 32" || true
  done
fi
echo "results in $out"
