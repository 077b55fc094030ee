"""scripts/gpu-check.sh, the one command a GPU session runs with a few minutes of device time:
its parts run here too (the CUDA tests skip, the benchmarks run on the CPU at their smallest),
so a broken script is found in CI, not on a lent GPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-check.sh"


def _run(part: str, env: dict[str, str], script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    # (each part has its own time limit in the script, the writer's 180 s per backend)
    return subprocess.run(["bash", str(script), part], env=env, capture_output=True, text=True, timeout=600)


def test_the_gpu_check_script_runs_its_parts_and_leaves_their_results(tmp_path: Path) -> None:
    """The parts as a GPU session runs them, one command each: the CUDA tests' summary, the
    data-path benchmark's report and JSON, and the writer's table for each backend, all in
    ``$OUT``."""
    out = tmp_path / "out"
    # (the CPU's path even where a GPU is: tests/gpu run on their own there)
    env = {**os.environ, "OUT": str(out), "TMPDIR": str(tmp_path), "PYTHON": sys.executable,
           "CUDA_VISIBLE_DEVICES": "", "GPU_ARGS": "--device cpu --smoke --index-only",
           "WRITER_ARGS": "--chunks 1 --rounds 1"}
    for part in ("tests", "gpu", "writer"):
        res = _run(part, env)
        assert res.returncode == 0, (part, res.stderr[-2000:])
        assert "failed or timed out" not in res.stderr, (part, res.stderr[-2000:])
    tests = (out / "tests.txt").read_text()
    assert re.search(r"\d+ (passed|skipped)", tests) and not re.search(r"\d+ (failed|errors?)\b", tests), tests
    assert "indexing ops on the device" in (out / "gpu_bench.md").read_text()
    assert set(json.loads((out / "gpu_bench.json").read_text())["indexing"]) == {"kv_last", "cpu"}
    log = (out / "log.txt").read_text()
    assert log.startswith("python ") and " torch " in log  # (what the machine had)
    for backend in ("files", "lmdb"):
        assert f"the store ({backend}) writes 1 chunks" in log
    assert log.count("| 1 | this checkout | writing |") == 2


def test_the_gpu_check_script_says_what_to_do_when_kvtiers_dependencies_are_missing(tmp_path: Path) -> None:
    """A GPU machine without lmdb and without the wheels carried along: the script stops at
    once (exit 2) and names the command that fetches them, before spending device time."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "scripts" / "gpu-check.sh")
    blocker = tmp_path / "blocker"  # (lmdb cannot be imported)
    blocker.mkdir()
    (blocker / "lmdb.py").write_text("raise ImportError('no lmdb on this machine')\n")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "PYTHONPATH": str(blocker)}
    res = _run("tests", env, tree / "scripts" / "gpu-check.sh")
    assert res.returncode == 2
    assert "run scripts/gpu-wheels.sh first" in res.stderr
    assert not (tmp_path / "out").exists()


def _wheel(folder: Path, name: str, tag: str, module: str) -> None:
    """A minimal wheel of a one-module package ``name``, tagged ``tag``."""
    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": module,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: kvtier-tests\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-1.0-{tag}.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def test_the_gpu_check_script_installs_the_carried_wheels_that_fit_its_python(tmp_path: Path) -> None:
    """``.gpu-wheels/`` carries kvtier's dependencies for several Python versions (the GPU
    machine's is not known in advance): the script installs, into a folder of its own, the
    ones that fit the Python it runs, and is not stopped by the others."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "scripts" / "gpu-check.sh")
    wheels = tree / ".gpu-wheels"
    wheels.mkdir()
    for name in ("lmdb", "zstandard", "xxhash"):
        _wheel(wheels, name, "py3-none-any", "CARRIED = True\n")
        _wheel(wheels, name, "cp30-cp30-manylinux2014_x86_64", "raise ImportError('the wrong wheel')\n")
    blocker = tmp_path / "blocker"  # (lmdb cannot be imported)
    blocker.mkdir()
    (blocker / "lmdb.py").write_text("raise ImportError('no lmdb on this machine')\n")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path), "PYTHON": sys.executable,
           "PYTHONPATH": str(blocker)}
    res = _run("none", env, tree / "scripts" / "gpu-check.sh")  # (no part: the set-up only)
    assert res.returncode == 0, res.stderr[-2000:]
    site = tmp_path / "kvtier-gpu-site"
    assert all((site / f"{name}.py").read_text() == "CARRIED = True\n" for name in ("lmdb", "zstandard", "xxhash"))
    assert "results in" in res.stdout
