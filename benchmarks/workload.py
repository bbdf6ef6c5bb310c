"""Shared pieces of the benchmark scripts: prompts cut from a text, machine facts."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from kvstrata.data import EMMA

DEFAULT_TEXT = EMMA


def prompts_from_text(tokenizer, count: int, length: int, text_file: Path = DEFAULT_TEXT) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, consecutive windows of the text."""
    ids = tokenizer.encode(text_file.read_text())
    if len(ids) < count * length:
        raise ValueError(f"{text_file} has {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
