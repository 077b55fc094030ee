"""The prompts file of a warm-up: JSON Lines, one prompt per line.

    {"prompt": "You are a support agent for ..."}                # text: tokenized by the model's tokenizer
    {"prompt_token_ids": [128000, 2675, 527, ...], "cache_salt": "tenant-a"}

A bad line is reported with its line number and skipped; the others still run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    line: int
    text: str | None
    token_ids: tuple[int, ...] | None
    cache_salt: str | None


@dataclass(frozen=True)
class PromptError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


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
    """Every good prompt and every bad line of ``path`` (blank lines are skipped)."""
    prompts: list[Prompt] = []
    errors: list[PromptError] = []
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            got = parse_prompt(n, text)
            (errors if isinstance(got, PromptError) else prompts).append(got)
    return prompts, errors
