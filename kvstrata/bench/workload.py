"""Prompts for benchmarks, cut from a text file."""

from __future__ import annotations

from pathlib import Path

from kvstrata.data import EMMA
from kvstrata.errors import KvstrataError


def prompts_from_text(tokenizer, count: int, length: int, text_file: Path = EMMA) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens: consecutive windows of the text."""
    ids = tokenizer.encode(text_file.read_text())
    if len(ids) < count * length:
        raise KvstrataError(f"{text_file} has {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]
