"""argparse types that refuse a bad value while the command line is read, before any model is loaded: a negative
count would otherwise slice a text from its end, and a file that cannot be written would be found out only after
minutes of work."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """A count of at least 1 (windows, tokens)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def output_file(text: str) -> Path:
    """A file to write: not a directory, and not under a file; directories that do not exist yet are made when it is
    written."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the path of a file to write")
    existing = next(parent for parent in path.absolute().parents if parent.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, not a directory to write {path.name} under")
    return path
