"""A fingerprint of model weights: two checkpoints under one name never share KV.

The fingerprint hashes the content of every weight file (and ``config.json``) of a model
directory with xxh3-128 — as fast as the disk reads — and combines names, sizes and digests
with SHA-256. Digests are cached per file (keyed by path, size, mtime and inode) in a small
JSON file, so a restart does not re-read gigabytes of unchanged weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import xxhash

from kvtier.backends.base import write_json_atomic

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")
# Files that are not weights but change what the weights compute (LoRA's rank/alpha/targets
# live in adapter_config.json).
EXTRA_FILES = ("config.json", "params.json", "adapter_config.json")
_READ = 8 << 20


def _file_digest(path: Path, buf: bytearray) -> str:
    h = xxhash.xxh3_128()
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def weights_fingerprint(model_dir: str | Path, cache_file: Path | None = None) -> str:
    """Fingerprint of the weight files under ``model_dir`` (recursively); ``sha256:<hex>``.

    ``model_dir`` may also be a single weight file (a ``.gguf`` checkpoint). Raises
    ``FileNotFoundError`` if there are no weight files.
    """
    root = Path(model_dir)
    if root.is_file():
        files, root = [root], root.parent
    else:
        files = sorted(
            p for p in root.rglob("*")
            if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in EXTRA_FILES)
        )
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) under {root}")
    cache: dict[str, dict[str, object]] = {}
    if cache_file is not None:
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
    buf = bytearray(_READ)
    combined = hashlib.sha256(b"kvtier-weights-v1\x00")
    changed = False
    for p in files:
        st = p.stat()
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
        entry = cache.get(str(p.resolve()))
        if entry and all(entry.get(k) == v for k, v in stamp.items()):
            digest = str(entry["digest"])
        else:
            digest = _file_digest(p, buf)
            cache[str(p.resolve())] = {**stamp, "digest": digest}
            changed = True
        combined.update(f"{p.relative_to(root).as_posix()}\x00{st.st_size}\x00{digest}\n".encode())
    if changed and cache_file is not None:
        try:
            cache_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_json_atomic(cache_file, cache)
        except OSError:
            pass  # a read-only cache location only costs a re-hash next time
    return "sha256:" + combined.hexdigest()


def resolve_model_dir(model: str, revision: str | None = None,
                      download_dir: str | None = None) -> Path | None:
    """Where ``model``'s files are on this machine, without any download: the path itself
    (a directory or a single checkpoint file), else its snapshot in the local hub cache
    (``download_dir`` when the server was given one). None when neither exists.

    A snapshot may hold only some files (a config fetched on its own); callers that need
    weights check for them (``weights_fingerprint`` raises ``FileNotFoundError``).
    """
    path = os.path.expanduser(model)
    if os.path.isdir(path) or os.path.isfile(path):
        return Path(path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True,
                                      cache_dir=download_dir))
    except Exception:
        return None
