"""Tokenizer loading and the text side of a request (decode, stop-string trimming)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    pass


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:  # transformers raises many types; the message says why
        raise TokenizerError(f"cannot load a tokenizer from {path}: {exc}") from exc


def trim_at_stop(text: str, matched: str | None, no_stop_trim: bool) -> str:
    """Cut the text where the stop string that ended generation begins."""
    if matched is None or no_stop_trim:
        return text
    at = text.find(matched)
    return text if at < 0 else text[:at]
