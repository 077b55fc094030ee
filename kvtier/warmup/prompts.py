"""The prompts file of a warm-up: JSON Lines, one prompt per line.

    {"prompt": "You are a support agent for ..."}                # text: tokenized by the model's tokenizer
    {"prompt_token_ids": [128000, 2675, 527, ...], "cache_salt": "tenant-a"}

A bad line is reported with its line number and skipped; the others still run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import KVTierError
from kvtier.keys import as_token_array


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``Prompt(text="...")`` (tokenized by the model's tokenizer) or
    ``Prompt(token_ids=[...])``, optionally with a ``cache_salt``; ``line`` is its line in a
    prompts file (0 for one made in code)."""

    line: int = 0
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("Prompt: give exactly one of text and token_ids")
        for name in ("text", "cache_salt"):  # (as a prompts file's line is checked)
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"Prompt: {name} must be a non-empty string, got {value!r}")
        if self.token_ids is not None:  # (a list is fine; kept as a tuple) checked as a save would
            object.__setattr__(self, "token_ids", tuple(int(t) for t in as_token_array(self.token_ids)))


@dataclass(frozen=True)
class PromptError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


class PromptsFileError(KVTierError):
    """The prompts file as a whole cannot be read (missing, a directory, not UTF-8 text)."""


_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def parse_prompt(line_no: int, text: str) -> Prompt | PromptError:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return PromptError(line_no, f"not JSON ({exc})")
    if not isinstance(obj, dict):
        return PromptError(line_no, "expected a JSON object with \"prompt\" or \"prompt_token_ids\"")
    unknown = set(obj) - _KEYS
    if unknown:
        return PromptError(line_no, f"unknown field(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        return PromptError(line_no, "give exactly one of \"prompt\" (text) and \"prompt_token_ids\"")
    salt = obj.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        return PromptError(line_no, "\"cache_salt\" must be a non-empty string")
    if has_text:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            return PromptError(line_no, "\"prompt\" must be a non-empty string")
        return Prompt(line_no, obj["prompt"], None, salt)
    ids = obj["prompt_token_ids"]
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in ids)):
        return PromptError(line_no, "\"prompt_token_ids\" must be a non-empty list of token ids (0 <= id < 2^32)")
    return Prompt(line_no, None, tuple(ids), salt)


def read_prompts(path: str | Path) -> tuple[list[Prompt], list[PromptError]]:
    """Every good prompt and every bad line of ``path`` (blank lines are skipped).

    Raises :class:`PromptsFileError` if the file cannot be read at all."""
    prompts: list[Prompt] = []
    errors: list[PromptError] = []
    try:
        data = Path(path).read_bytes()  # bytes: a decoding error can then name its line
    except FileNotFoundError:
        raise PromptsFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PromptsFileError(f"{path}: is a directory; pass a JSON Lines file") from None
    except PermissionError:
        raise PromptsFileError(f"{path}: permission denied; make the file readable") from None
    for n, raw in enumerate(data.splitlines(), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # the whole file is in another encoding, or binary
            raise PromptsFileError(
                f"{path}: line {n} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                "save the prompts file as UTF-8 JSON Lines") from None
        if not text.strip():
            continue
        got = parse_prompt(n, text)
        (errors if isinstance(got, PromptError) else prompts).append(got)
    return prompts, errors
