"""Parsing and printing of byte sizes and durations (``50G``, ``512MiB``, ``7d``)."""

from __future__ import annotations

import math
import re

from kvtier.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Upper bounds: a digit string too long for a float reads as infinity, and sizes end up in
# C integers (LMDB map sizes, file offsets) and ages in nanosecond timestamps.
MAX_SIZE = 2**63 - 1  # 8 EiB
MAX_AGE_S = 1000 * 365 * 86400.0  # 1000 years


def _shown(value: object) -> str:
    """``value`` for a message, shortened (a pasted megabyte must not fill the terminal)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...{text[-6:]} ({len(str(value))} characters)"


def parse_size(value: int | str, setting: str = "size") -> int:
    """``"50G"`` -> bytes. Bare K/M/G/T are binary (1024-based); ``KB``/``MB`` are decimal."""
    if isinstance(value, bool):
        raise ConfigError(f"{setting}: expected a size such as 512M or 50G, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))  # (a sign: said below)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{setting}: cannot read {_shown(value)} as a size; use a number of bytes or a "
                "number with a unit: K, M, G, T (binary) or KB, MB, GB, TB (decimal), e.g. 50G"
            )
        f = float(m.group(1)) * _SIZE_UNITS[unit]
        if math.isfinite(f) and _SIZE_UNITS[unit] == 1 and not f.is_integer():  # 1.5 bytes: a slip
            raise ConfigError(f"{setting}: {_shown(value)} is not a whole number of bytes; "
                              "give bytes, or a unit, e.g. 1.5G")
        n = int(f) if math.isfinite(f) else MAX_SIZE + 1  # (no int of inf)
    if n < 0:
        raise ConfigError(f"{setting}: must not be negative, got {value!r}")
    if n > MAX_SIZE:
        raise ConfigError(f"{setting}: {_shown(value)} is too large a size; use at most 8 EiB (e.g. 50G or 2T)")
    return n


def parse_age(value: str, setting: str = "age") -> float:
    """``"7d"`` -> seconds. Units: s, m, h, d, w."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", str(value).lower())
    if not m:
        raise ConfigError(
            f"{setting}: cannot read {_shown(value)} as an age; use a number with a unit "
            "s, m, h, d or w, e.g. 90m or 7d"
        )
    seconds = float(m.group(1)) * _AGE_UNITS[m.group(2)]
    if not math.isfinite(seconds) or seconds > MAX_AGE_S:
        raise ConfigError(f"{setting}: {_shown(value)} is too long an age; use at most 1000 years "
                          "(52000w), e.g. 90m or 7d")
    return seconds


def format_size(n: float) -> str:
    """Bytes as a short human string: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_age(seconds: float) -> str:
    """Seconds as a short human string: ``3.2h``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
