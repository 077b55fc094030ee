"""Store configuration: every setting, its default, and validation with clear messages.

``docs/configuration.md`` explains each setting and why its default is what it is.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.units import parse_size

BACKENDS = ("lmdb", "files")
DURABILITY = ("process", "power")
COMPRESSION = ("none", "zstd")
# Longer waits than this are a mistake (and past what a thread join can take).
MAX_CLOSE_TIMEOUT_S = 86400.0
MAX_READ_TIMEOUT_S = 3600.0  # an hour: a longer wait is a hang to a server


def default_store_path() -> Path:
    """``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``."""
    if os.environ.get("KVTIER_CACHE_DIR"):
        return Path(os.environ["KVTIER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier"


@dataclass
class CacheConfig:
    """Settings of one store. Sizes accept ints (bytes) or strings such as ``"512M"``.

    Read-only once built: a store keeps the config it was opened with and reads some
    settings later, so a change made afterwards would apply partly or not at all. Make a
    changed copy with :meth:`replaced`.
    """

    path: Path = dataclasses.field(default_factory=default_store_path)
    # A new store's backend; an existing store keeps its own, which a config that does not
    # name one follows (see ``validate``).
    backend: str = "files"
    chunk_tokens: int = 256
    host_bytes: int | str = "1G"
    disk_bytes: int | str = "64G"
    write_queue_bytes: int | str = "256M"
    durability: str = "process"
    compression: str = "none"
    compression_level: int = 3
    io_threads: int = 4
    # files backend: read record files the page cache does not hold with O_DIRECT, straight
    # into pooled buffers (docs/configuration.md says when it pays)
    direct_reads: bool = False
    commit_bytes: int | str = "256M"
    max_record_bytes: int | str = "1G"
    close_timeout_s: float = 30.0
    # A chunk read that has not returned this long after it was asked for (a hung network
    # mount, a dying disk) is given up: a miss for the caller, never a wait for good
    read_timeout_s: float = 10.0
    # The shared remote tier (see docs/scale-out.md): a redis://, rediss:// or
    # redis+cluster:// address, or None for none.
    remote: str | None = None
    remote_password: str | None = dataclasses.field(default=None, repr=False)  # never logged
    remote_tls_ca: str | None = None  # CA file that signed the server's certificate (rediss://)
    remote_timeout_s: float = 0.5
    remote_part_bytes: int | str = "4M"
    remote_queue_bytes: int | str = "256M"

    def __new__(cls, *args: Any, **kwargs: Any) -> CacheConfig:
        # Which settings the caller chose (by position or name), as opposed to defaults: a
        # writer records only those in a store shared with others (see ``chosen``).
        self = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        object.__setattr__(self, "_chosen", frozenset(names[:len(args)]) | frozenset(kwargs))
        return self

    def __post_init__(self) -> None:
        self.validate()
        object.__setattr__(self, "_built", True)  # (pickles and copies carry it along)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_built"):
            raise ConfigError(_read_only(name))
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_built"):
            raise ConfigError(_read_only(name))
        object.__delattr__(self, name)

    def _normalize(self, name: str, value: object) -> None:
        """Store a validated setting's canonical form (validation is the one writer)."""
        object.__setattr__(self, name, value)

    def _follow_store_backend(self, backend: str) -> None:
        """Take the backend of the store at ``path`` if this config named none (a store
        another process created after this config was made); a named one is kept."""
        if "backend" not in self.chosen:
            _choice("backend", backend, BACKENDS)
            self._normalize("backend", backend)

    @property
    def chosen(self) -> frozenset[str]:
        """The settings given when this config was made (the others are defaults)."""
        # (a config pickled by a kvtier before this attribute: every setting counts as given)
        return getattr(self, "_chosen", frozenset(f.name for f in dataclasses.fields(self)))

    def replaced(self, **changes: Any) -> CacheConfig:
        """A copy with ``changes``, keeping which settings were chosen; the others are
        derived again (``dataclasses.replace`` would count every setting as chosen, and keep
        a backend followed from the old path's store)."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in self.chosen}
        return type(self)(**{**given, **changes})

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "kvtier config",
                  also_known: tuple[str, ...] = ()) -> CacheConfig:
        """Build from a plain dict (e.g. vLLM's ``kv_connector_extra_config``).

        Unknown keys are an error, with the closest known name suggested.
        """
        if not isinstance(values, Mapping):  # (a list's items read as unknown setting names)
            raise ConfigError(f"{where}: expected a dict of settings, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} | set(also_known)
        for key in values:
            if not isinstance(key, str):
                raise ConfigError(f"{where}: setting names are strings, got {key!r}")
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"{where}: unknown setting {key!r}{hint}; known settings: {', '.join(sorted(known))}"
                )
        return cls(**values)

    def validate(self) -> None:
        if isinstance(self.path, str):
            if not self.path.strip():
                raise ConfigError("path: must name a directory, got an empty string")
            self._normalize("path", Path(self.path))
        if not isinstance(self.path, Path):
            raise ConfigError(f"path: expected a directory path, got {self.path!r}")
        if "\0" in str(self.path):
            raise ConfigError(f"path: {str(self.path)!r} contains a NUL character")
        # absolute once: threads and pools open files under it later, after any os.chdir
        self._normalize("path", self.path.expanduser().absolute())
        if self.path.is_symlink() and not self.path.exists():
            raise ConfigError(f"path: {self.path} is a symbolic link to nothing ({os.readlink(self.path)}); "
                              "create its target or choose another path")
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"path: {self.path} exists and is not a directory; choose a directory for the store")
        above = next((p for p in self.path.parents if p.exists()), None)  # (the nearest that exists)
        if above is not None and not above.is_dir():
            raise ConfigError(f"path: {self.path} is under {above}, which is not a directory; "
                              "choose a directory for the store")
        if "backend" not in self.chosen:
            self._normalize("backend", _store_backend(self.path) or self.backend)
        _choice("backend", self.backend, BACKENDS)
        _choice("durability", self.durability, DURABILITY)
        _choice("compression", self.compression, COMPRESSION)
        positive_int("chunk_tokens", self.chunk_tokens)
        positive_int("io_threads", self.io_threads)
        if not isinstance(self.direct_reads, bool):
            raise ConfigError(f"direct_reads: must be true or false, got {self.direct_reads!r}")
        if isinstance(self.compression_level, bool) or not isinstance(self.compression_level, int) or not 1 <= self.compression_level <= 22:
            raise ConfigError(f"compression_level: must be an integer from 1 to 22, got {self.compression_level!r}")
        self._normalize("host_bytes", parse_size(self.host_bytes, "host_bytes"))
        self._normalize("disk_bytes", parse_size(self.disk_bytes, "disk_bytes"))
        self._normalize("write_queue_bytes", parse_size(self.write_queue_bytes, "write_queue_bytes"))
        self._normalize("commit_bytes", parse_size(self.commit_bytes, "commit_bytes"))
        self._normalize("max_record_bytes", parse_size(self.max_record_bytes, "max_record_bytes"))
        if self.disk_bytes == 0:
            raise ConfigError("disk_bytes: must be above 0; the persistent tier needs a byte budget (e.g. 64G)")
        if self.write_queue_bytes == 0:
            raise ConfigError("write_queue_bytes: must be above 0 (and hold at least one chunk), e.g. 256M")
        if self.commit_bytes == 0:
            raise ConfigError("commit_bytes: must be above 0 (e.g. 64M)")
        if isinstance(self.close_timeout_s, bool) or not isinstance(self.close_timeout_s, int | float) \
                or not 0 < self.close_timeout_s <= MAX_CLOSE_TIMEOUT_S:
            raise ConfigError(f"close_timeout_s: must be a number of seconds above 0 and at most "
                              f"{MAX_CLOSE_TIMEOUT_S:.0f} (a day), got {self.close_timeout_s!r}")
        if isinstance(self.read_timeout_s, bool) or not isinstance(self.read_timeout_s, int | float) \
                or not 0 < self.read_timeout_s <= MAX_READ_TIMEOUT_S:
            raise ConfigError(f"read_timeout_s: must be a number of seconds above 0 and at most "
                              f"{MAX_READ_TIMEOUT_S:.0f}, got {self.read_timeout_s!r}")
        self._validate_remote()
        if self.max_record_bytes < 4096:
            raise ConfigError("max_record_bytes: must be at least 4K")

    def _validate_remote(self) -> None:
        self._normalize("remote_part_bytes", parse_size(self.remote_part_bytes, "remote_part_bytes"))
        self._normalize("remote_queue_bytes", parse_size(self.remote_queue_bytes, "remote_queue_bytes"))
        if self.remote_password is not None and not isinstance(self.remote_password, str):
            raise ConfigError("remote_password: must be a string")
        if self.remote_tls_ca is not None and not Path(str(self.remote_tls_ca)).expanduser().is_file():
            raise ConfigError(f"remote_tls_ca: {self.remote_tls_ca} is not a readable file; give the "
                              "PEM file of the CA that signed the server's certificate")
        if isinstance(self.remote_timeout_s, bool) or not isinstance(self.remote_timeout_s, int | float) \
                or not 0 < self.remote_timeout_s <= 60:
            raise ConfigError(f"remote_timeout_s: must be seconds above 0 and at most 60, got {self.remote_timeout_s!r}")
        if not (64 << 10) <= self.remote_part_bytes <= (512 << 20):
            raise ConfigError("remote_part_bytes: must be from 64K to 512M (the piece a load reads at a "
                              "time; Redis refuses values over its proto-max-bulk-len, 512M by default)")
        if self.remote is not None:
            from kvtier.remote.address import parse_remote

            parse_remote(self.remote, self.remote_password)  # a clear error now, not at first use
            if self.remote_queue_bytes == 0:
                raise ConfigError("remote_queue_bytes: must be above 0 when remote is set, e.g. 256M")

    def to_dict(self) -> dict[str, Any]:
        """The resolved values (sizes as ints, the path as a string), which
        :meth:`from_dict` accepts back; with the password, if one is set: keep it private."""
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        return d

    def __repr__(self) -> str:
        # a password written into the remote URL is hidden like remote_password (never logged)
        from kvtier.remote.address import redact

        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}
        values["remote"] = redact(self.remote)
        shown = ", ".join(f"{name}={value!r}" for name, value in values.items())
        return f"CacheConfig({shown})"


def _read_only(name: str) -> str:
    # (no value in the message: it could be the remote password)
    known = [f.name for f in dataclasses.fields(CacheConfig)]
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        return (f"{name}: not a CacheConfig setting{f' (did you mean {close[0]!r}?)' if close else ''}, "
                "and a CacheConfig cannot be changed once built")
    return (f"{name}: a CacheConfig cannot be changed once built (a store may be using it already, "
            f"and would apply the change partly or not at all); make a changed copy with "
            f"config.replaced({name}=...), which keeps which settings were given, or build a new CacheConfig")


def _store_backend(path: Path) -> str | None:
    """The backend of the store at ``path``, if one is there and its marker reads (opening
    it reports a marker that does not)."""
    from kvtier.backends import MARKER, read_marker
    from kvtier.errors import KVTierError

    try:
        if not (path / MARKER).exists():
            return None
        return str(read_marker(path)["backend"])
    except (KVTierError, OSError):  # (e.g. another user's store: opening says so)
        return None


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def seconds(name: str, value: object) -> None:
    """A number of seconds (a call's wait or timeout; numpy's too). One below 0 is a time
    already past, as in ``flush(deadline - now)``: no wait."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ConfigError(f"{name}: must be a number of seconds, got {value!r}")


def positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
