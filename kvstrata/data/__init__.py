"""Texts shipped with the package: Jane Austen's *Emma* (public domain), for tests, prompts and evaluations."""

from pathlib import Path

EMMA = Path(__file__).parent / "emma.txt"
