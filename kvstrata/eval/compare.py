"""`--compare`: several engine configurations in one evaluation run.

A comparison is a comma-separated list of configurations; each one is a '+'-joined list of
engine options that override the command's flags, e.g. `--compare dtype=float32,dtype=bfloat16`
or `--compare chunk_size=64,chunk_size=512+block_size=32`.
"""

from __future__ import annotations

import dataclasses
import typing

from kvstrata.config import EngineConfig
from kvstrata.errors import KvstrataError
from kvstrata.option_dependencies import refuse_options_without_effect


def _convert(name: str, text: str, annotation) -> object:
    if annotation is bool:
        if text.lower() not in ("true", "false"):
            raise KvstrataError(f"--compare: {name} takes true or false, got {text!r}")
        return text.lower() == "true"
    if annotation is float:
        try:
            return float(text)
        except ValueError as exc:
            raise KvstrataError(f"--compare: {name} takes a number, got {text!r}") from exc
    wants_int = annotation is int or (int in typing.get_args(annotation) and name != "kv_cache_memory")
    if wants_int:
        try:
            return int(text)
        except ValueError as exc:
            raise KvstrataError(f"--compare: {name} takes an integer, got {text!r}") from exc
    return text


def compared_options(compare: str | None) -> tuple[str, ...]:
    """The engine options a comparison sets, in the order first named."""
    return tuple(dict.fromkeys(name for spec in compare.split(",") for name, _ in _overrides(spec))) if compare else ()


def configurations(base: EngineConfig, compare: str | None) -> list[tuple[str, EngineConfig]]:
    """(label, config) for each configuration to evaluate; just the base when `compare` is empty. An option a
    configuration sets where it acts nowhere is refused."""
    if not compare:
        return [("base", base)]
    hints = typing.get_type_hints(EngineConfig)
    result = []
    for spec in compare.split(","):
        overrides = {name: _convert(name, value, hints[name]) for name, value in _overrides(spec)}
        config = dataclasses.replace(base, **overrides)
        try:
            refuse_options_without_effect(config, checked=tuple(overrides))
        except KvstrataError as exc:
            raise KvstrataError(f"--compare {spec!r}: {exc}") from None
        result.append((spec, config))
    return result


def _overrides(spec: str) -> list[tuple[str, str]]:
    """(option, value text) for each OPTION=VALUE item of one configuration."""
    hints = typing.get_type_hints(EngineConfig)
    pairs = []
    for item in spec.split("+"):
        name, _, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if name not in hints or not value:
            raise KvstrataError(f"--compare item {item!r} is not OPTION=VALUE with OPTION one of {', '.join(hints)}")
        pairs.append((name, value.strip()))
    return pairs
