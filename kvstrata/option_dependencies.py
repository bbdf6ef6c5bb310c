"""Engine options that act only beside another option's value: --kivi-residual with a KIVI format, --h2o-budget with
--kv-offload h2o, --kv-store-format with a --kv-store, ...

An option given where it has no effect is refused, not ignored: whoever typed it expected it to change something, and a
benchmark or an evaluation run without it reports figures for a setting that never applied. A command that builds
engines with other values of an option than the one given (bench offload runs every --kv-offload mode) names that
option as varied, and the options it decides are then taken as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from kvstrata.config import EngineConfig
from kvstrata.errors import KvstrataError
from kvstrata.kv.cache_factory import RECORD_FORMATS
from kvstrata.kv.store.forms import LEVELS_FORM, parse_tier_forms
from kvstrata.kv.store.spec import tier_kinds

# the options of a KV format, by format: they change what its stored tokens hold, so they also name its block hashes
FORMAT_OPTIONS = {
    "int4": ("int4_group_size",),
    "kivi4": ("kivi_residual",),  # which blocks hold quantized and which float16 K/V
    "kivi2": ("kivi_residual",),
    "oaken": ("oaken_calibration", "oaken_ratios", "oaken_keys", "oaken_key_centering", "oaken_group_shift",
              "oaken_outliers", "oaken_scales"),
}
INFINIGEN_OPTIONS = ("infinigen_alpha", "infinigen_partial_ratio", "infinigen_max_fraction", "infinigen_full_layers",
                     "infinigen_recent", "infinigen_calibration", "infinigen_diagnostics")


@dataclass(frozen=True)
class Dependency:
    options: tuple[str, ...]  # EngineConfig fields that act only where `applies` holds
    decided_by: tuple[str, ...]  # the fields `applies` reads
    applies: Callable[[EngineConfig], bool]
    needs: str  # what makes them act, in flags


def _store_kinds(c: EngineConfig) -> list[str | None]:
    return tier_kinds(c.kv_store) if c.kv_store else []


def _stores_levels(c: EngineConfig) -> bool:
    return LEVELS_FORM in parse_tier_forms(c.kv_store_format, _store_kinds(c)) if c.kv_store else False


def _format_dependencies() -> list[Dependency]:
    """One for each set of options, acting under any format that has them (the residual under kivi4 and kivi2)."""
    formats_of: dict[tuple[str, ...], list[str]] = {}
    for name, options in FORMAT_OPTIONS.items():
        formats_of.setdefault(options, []).append(name)
    return [Dependency(options, ("kv_format",), _in_formats(tuple(names)), _format_flags(names))
            for options, names in formats_of.items()]


def _in_formats(names: tuple[str, ...]) -> Callable[[EngineConfig], bool]:
    return lambda c: bool(set(names) & set(c.kv_format_sides()))


def _format_flags(names: list[str]) -> str:
    sides = [name for name in names if name in RECORD_FORMATS]  # these may also store K or V alone
    return f"--kv-format {' or '.join(names)}" + (f" (or as one side, e.g. int8/{sides[0]})" if sides else "")


DEPENDENCIES = (
    *_format_dependencies(),
    Dependency(INFINIGEN_OPTIONS, ("kv_offload",), lambda c: c.kv_offload == "infinigen", "--kv-offload infinigen"),
    Dependency(("kv_host_eviction",), ("kv_host_memory",), lambda c: c.kv_host_memory is not None,
               "--kv-host-memory (a cap on InfiniGen's host pool)"),
    Dependency(("h2o_budget",), ("kv_offload",), lambda c: c.kv_offload == "h2o", "--kv-offload h2o"),
    Dependency(("kv_link",), ("kv_offload",), lambda c: c.kv_offload != "none", "--kv-offload full, infinigen or h2o"),
    Dependency(("tile",), ("scheduler",), lambda c: c.scheduler == "sarathi", "--scheduler sarathi"),
    Dependency(("max_prefill_tokens",), ("scheduler",), lambda c: c.scheduler == "prefill-first",
               "--scheduler prefill-first"),
    Dependency(("prompt_lookup_min", "prompt_lookup_max", "speculative_disable_by_batch_size"),
               ("num_speculative_tokens",), lambda c: c.num_speculative_tokens > 0,
               "--num-speculative-tokens 1 or more"),
    Dependency(("lora_dtype",), ("enable_lora", "lora_modules"), lambda c: c.lora_enabled,
               "--enable-lora or --lora-modules"),
    Dependency(("kv_store_format", "kv_store_chunk_tokens"), ("kv_store",), lambda c: bool(c.kv_store), "--kv-store"),
    Dependency(("kv_store_eviction",), ("kv_store",), lambda c: "host" in _store_kinds(c),
               "a host tier in --kv-store (host:SIZE)"),
    Dependency(("kv_store_timeout_ms", "kv_store_link_gbps"), ("kv_store",), lambda c: "redis" in _store_kinds(c),
               "a Redis tier in --kv-store (redis://HOST:PORT)"),
    Dependency(("kv_store_level",), ("kv_store", "kv_store_format"), _stores_levels,
               f"a --kv-store tier stored in the {LEVELS_FORM} form (--kv-store-format {LEVELS_FORM} or "
               f"TIER={LEVELS_FORM})"),
    Dependency(("ttft_slo",), ("kv_store", "kv_store_format", "kv_store_level"),
               lambda c: _stores_levels(c) and c.kv_store_level == "auto",
               f"a --kv-store tier stored in the {LEVELS_FORM} form and --kv-store-level auto (streaming aims at it)"),
    Dependency(("impress_ratio", "impress_attend"), ("prefix_loading",),
               lambda c: c.prefix_loading in ("impress", "h2o-keys"), "--prefix-loading impress or h2o-keys"),
    Dependency(("impress_rule", "impress_reorder_seconds"), ("prefix_loading",),
               lambda c: c.prefix_loading == "impress", "--prefix-loading impress"),
)


def refuse_options_without_effect(config: EngineConfig, varied: tuple[str, ...] = (),
                                  checked: tuple[str, ...] | None = None) -> None:
    """A KvstrataError naming each option set away from its default where the options it depends on make it act
    nowhere. `varied`: options the command sets itself in the engines it builds, whatever was given; `checked`: the
    options to look at (default: all)."""
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    problems = []
    for dependency in DEPENDENCIES:
        if set(dependency.decided_by) & set(varied) or dependency.applies(config):
            continue
        given = [name for name in dependency.options
                 if getattr(config, name) != defaults[name] and (checked is None or name in checked)]
        if given:
            here = ", ".join(_flag_and_value(config, name) for name in dependency.decided_by)
            problems.append(f"{', '.join(_flag_and_value(config, name) for name in given)} acts only with "
                            f"{dependency.needs}; this command has {here}")
    if problems:
        raise KvstrataError("; ".join(problems) + ". Drop the option, or give what it needs")


def _flag_and_value(config: EngineConfig, name: str) -> str:
    flag, value = "--" + name.replace("_", "-"), getattr(config, name)
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value}" if value is not None else f"no {flag}"
