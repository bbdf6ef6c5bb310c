"""Benchmark flags that take a comma-separated list of counts (`--requests 8,32`, `--chunks 256,512`)."""

from __future__ import annotations

from kvstrata.errors import KvstrataError


def positive_ints(text: str, flag: str) -> list[int]:
    """The positive integers `text` lists, comma-separated; a clear error naming `--flag` otherwise."""
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise KvstrataError(f"--{flag} takes positive integers, comma-separated, got {text!r}")
    return values
