"""What the model a server runs *is*, for the namespace: the weights vLLM actually loads, the
config it built, the loader options, and each LoRA adapter's weights.

A cache keyed by a model's *name* serves stale KV the day new weights appear under that name.
So kvtier caches only when it can fingerprint what is loaded: the weight files (hashed, see
:mod:`kvtier.fingerprint`), or the user's explicit ``weights_fingerprint``. Everything else
raises :class:`IdentityUnavailable`, whose message says what to set; the connector then turns
itself off and the server runs without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.fingerprint import resolve_model_dir, weights_fingerprint

log = logging.getLogger("kvtier")

# Load formats that read the checkpoint's own files from the model's directory (or its
# snapshot in the hub cache): hashing those files fingerprints what is loaded.
LOCAL_FILE_FORMATS = frozenset({
    "auto", "hf", "safetensors", "pt", "npcache", "fastsafetensors", "instanttensor", "mistral",
    "sharded_state", "gguf", "bitsandbytes",
})
# Streamers read a local directory (hashable) or an object-store URI (not).
STREAMER_FORMATS = frozenset({"runai_streamer", "runai_streamer_sharded"})
# Everything else (tensorizer, ipc_cache, modelexpress, a custom registered loader) loads
# weights from somewhere kvtier cannot see: an explicit weights_fingerprint is required.

# Keys of the HF config dict that name where it came from, not what it computes.
_CONFIG_NOISE = ("transformers_version", "_name_or_path", "_commit_hash")
SET_FINGERPRINT = ('set "weights_fingerprint" in kv_connector_extra_config to a string that '
                   'changes whenever the weights change')


class IdentityUnavailable(Exception):
    """kvtier cannot tell which weights are loaded; the message says what to set."""


def load_format_name(load_config: Any) -> str:
    fmt = getattr(load_config, "load_format", "auto")
    return str(getattr(fmt, "value", fmt)).lower()  # an enum in some vLLM versions


def config_digest(cfg: Any) -> str:
    """SHA-256 of the HF config the engine built (for vLLM: ``hf_config_path`` and
    ``hf_overrides``, callable ones included, applied): what the model computes with, not
    the file next to the weights."""
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise IdentityUnavailable(f"vLLM's model config has no HF config to fingerprint ({type(cfg).__name__})")
    d = {k: v for k, v in cfg.to_dict().items() if k not in _CONFIG_NOISE}
    blob = json.dumps(d, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def model_fingerprint(vllm_config: Any, user_fingerprint: str | None, cache_file: Path | None) -> str:
    """The weights' fingerprint for a vLLM engine: the user's, else a hash of the files it loads.

    Raises :class:`IdentityUnavailable` when neither is possible.
    """
    mc, lc = vllm_config.model_config, vllm_config.load_config
    revision = getattr(mc, "revision", None)
    fmt = load_format_name(lc)
    if fmt == "dummy" and not user_fingerprint:
        # Generated from a fixed seed by this vLLM version's initializer, from the config.
        import vllm

        return f"dummy:vllm-{vllm.__version__}:{config_digest(getattr(mc, 'hf_config', None))}"
    return weights_identity(
        str(mc.model), load_format=fmt, user_fingerprint=user_fingerprint, cache_file=cache_file,
        revision=getattr(revision, "resolved", None) or (str(revision) if revision else None),
        download_dir=getattr(lc, "download_dir", None),
        streamed_from=getattr(mc, "model_weights", None))


def weights_identity(model: str, *, load_format: str = "auto", user_fingerprint: str | None = None,
                     cache_file: Path | None = None, revision: str | None = None,
                     download_dir: str | None = None, streamed_from: str | None = None) -> str:
    """The one rule for a weights fingerprint (the connector's and offline warm-up's)."""
    if user_fingerprint:
        return user_fingerprint
    if streamed_from:
        # An object-store model: vLLM copied only its config files to a local directory.
        raise IdentityUnavailable(
            f"the weights of {streamed_from!r} are streamed from object storage, which kvtier "
            f"cannot hash; {SET_FINGERPRINT}")
    if load_format in STREAMER_FORMATS and not os.path.exists(os.path.expanduser(model)):
        raise IdentityUnavailable(
            f"load_format {load_format!r} streams {model!r} from outside this machine, so kvtier "
            f"cannot hash its weights; {SET_FINGERPRINT}")
    if load_format not in LOCAL_FILE_FORMATS | STREAMER_FORMATS:
        raise IdentityUnavailable(
            f"load_format {load_format!r} loads weights kvtier cannot hash; {SET_FINGERPRINT}")
    model_dir = resolve_model_dir(model, revision, download_dir)
    where = f" or in the hub cache{f' under download_dir {download_dir}' if download_dir else ''}"
    if model_dir is None:
        raise IdentityUnavailable(
            f"cannot find the weight files of {model!r} on this machine (not a local path{where}); "
            f"{SET_FINGERPRINT}")
    try:
        return weights_fingerprint(model_dir, cache_file)
    except FileNotFoundError as exc:
        raise IdentityUnavailable(f"cannot fingerprint {model!r}: {exc}; {SET_FINGERPRINT}") from exc


@dataclass(frozen=True)
class _AdapterKey:
    name: str
    int_id: int
    path: str


class LoraFingerprints:
    """Fingerprints of LoRA adapters' weights, for request keys.

    vLLM loads an adapter once per ``lora_int_id`` and keeps it until it is evicted or a
    request asks for ``load_inplace``; kvtier hashes the adapter's files the first time it sees
    it in this process and again on ``load_inplace``, so a restart or an in-place reload after
    retraining gets a new fingerprint. Per-file digests are cached on disk like the model's.
    """

    def __init__(self, cache_file: Path | None, download_dir: str | None = None) -> None:
        self.cache_file = cache_file
        self.download_dir = download_dir
        self._known: dict[_AdapterKey, str | None] = {}

    def fingerprint(self, lora: Any) -> str | None:
        """The adapter's weights fingerprint, or None if its files cannot be found. The name
        and id are not part of it: the same weights under two names give the same KV."""
        key = _AdapterKey(str(lora.lora_name), int(lora.lora_int_id), str(getattr(lora, "lora_path", "") or ""))
        if key in self._known and not getattr(lora, "load_inplace", False):
            return self._known[key]
        fp: str | None = None
        where = resolve_model_dir(key.path, None, self.download_dir) if key.path else None
        if where is not None:
            try:
                fp = weights_fingerprint(where, self.cache_file)
            except (FileNotFoundError, OSError) as exc:
                log.warning("kvtier: cannot fingerprint LoRA adapter %r (%s); its requests are not cached",
                            key.name, exc)
        elif key not in self._known:
            log.warning("kvtier: LoRA adapter %r: no local files at %r; its requests are not cached",
                        key.name, key.path)
        self._known[key] = fp
        return fp
