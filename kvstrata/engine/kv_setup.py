"""Builds the engine's KV storage for `--kv-format`: the format registry (kv/cache_factory.py) plus what only
the engine can supply, Oaken's thresholds for the loaded model (shipped, cached, or calibrated now on a
full-precision twin of the engine)."""

from __future__ import annotations

import dataclasses

import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv.cache_factory import FLOAT_FORMAT_OF_DTYPE, CacheShape, FormatOptions, StorageLayout, storage_layout
from kvstrata.kv.formats.oaken.format import OakenFormat
from kvstrata.kv.formats.oaken.groups import OakenConfig, parse_ratios
from kvstrata.kv.formats.oaken.thresholds import (
    DEFAULT_RATIOS,
    OakenThresholds,
    default_thresholds,
    same_ratios,
    stored_thresholds,
)
from kvstrata.option_dependencies import FORMAT_OPTIONS


def engine_storage_layout(engine, model_dtype: torch.dtype, kv_format: str | None = None) -> StorageLayout:
    """The layout of `kv_format` (default: the engine's own) for the engine's model."""
    c, mc = engine.config, engine.loaded.config
    shape = CacheShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, c.block_size)
    options = FormatOptions(c.int4_group_size, c.kivi_residual, c.chunk_size,
                            oaken_format=lambda: oaken_format_for(engine), in_place_decode=c.paged_kernel,
                            cascade_min_tokens=c.cascade_min_tokens)
    return storage_layout(kv_format or kv_format_name(c, model_dtype), shape, options)


def kv_format_name(config, model_dtype: torch.dtype) -> str:
    """The engine's KV format: `--kv-format`, or the float format of the dtype the model computes in."""
    return config.kv_format or FLOAT_FORMAT_OF_DTYPE[model_dtype]


def stored_form(config, model_dtype: torch.dtype) -> str:
    """The KV format with every option that changes what a token's stored K/V hold, and the dtype they were
    computed in: block hashes are namespaced by it (and by the model's fingerprint), so KV of one form never
    stands in for another's."""
    name = kv_format_name(config, model_dtype)
    # each side's options where K and V are in two formats (KEYS/VALUES)
    options = tuple(getattr(config, option) for side in name.split("/") for option in FORMAT_OPTIONS.get(side, ()))
    computed = FLOAT_FORMAT_OF_DTYPE[model_dtype]
    return f"{name}{options}@{computed}" if options else f"{name}@{computed}"


def oaken_format_for(engine) -> OakenFormat:
    """The engine's Oaken format: its calibration file, or the model's shipped or first-use calibration."""
    c, mc = engine.config, engine.loaded.config
    ratios = parse_ratios(c.oaken_ratios, "oaken_ratios") if c.oaken_ratios else None
    if c.oaken_calibration:
        thresholds = OakenThresholds.load(c.oaken_calibration, engine.model_fingerprint)
        if ratios is not None and not same_ratios(ratios, thresholds.ratios):
            raise KvstrataError(f"oaken_ratios {c.oaken_ratios} differ from the ratios {thresholds.ratios} that "
                                f"{c.oaken_calibration} was calibrated for")
    else:
        ratios = ratios or DEFAULT_RATIOS
        # the full-precision twin engine is built only if there is nothing stored to load
        thresholds = (stored_thresholds(engine.model_fingerprint, ratios)
                      or default_thresholds(_full_precision_twin(engine), ratios))
    config = OakenConfig(ratios=thresholds.ratios, group_shift=c.oaken_group_shift, outliers=c.oaken_outliers,
                         scales=c.oaken_scales)
    return OakenFormat(mc.num_kv_heads, mc.head_dim, thresholds, config, c.oaken_keys,
                       getattr(engine.loaded.model, "rotary", None), c.oaken_key_centering, engine.max_model_len)


def _full_precision_twin(engine):
    """An engine on the same weights with a full-precision cache: what calibration runs on, since the
    quantized cache is still being built."""
    return type(engine)(dataclasses.replace(engine.config, kv_format=None), loaded=engine.loaded)
