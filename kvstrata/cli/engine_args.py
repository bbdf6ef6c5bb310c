"""Command-line flags for every `EngineConfig` field, generated from the dataclass."""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, fields

from kvstrata.config import EngineConfig
from kvstrata.option_dependencies import refuse_options_without_effect


def _flag_type(annotation: str):
    if annotation.startswith("int | str"):  # a memory size, "2GiB" or bytes: EngineConfig parses it
        return str
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        if hints[f.name] is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        default = None if f.default is MISSING else f.default
        group.add_argument(
            flag,
            type=_flag_type(str(f.type)),
            default=default,
            choices=f.metadata.get("choices"),
            help=help_text if "default" in help_text else f"{help_text} (default: {default})",
        )


def engine_config_from_args(args: argparse.Namespace, varied: tuple[str, ...] = ()) -> EngineConfig:
    """The engine configuration the flags give; an option that would act nowhere is refused (`varied`: options the
    command sets itself in the engines it builds)."""
    config = EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()})
    refuse_options_without_effect(config, varied)
    return config
