"""Builds the engine's attention policy for `--kv-offload`, with what only the engine can supply: InfiniGen's
skew for the loaded model (a named file, the shipped one, a cached one, or calibrated now on a twin engine whose
KV stays on the device) and the model's queries of an earlier layer's input."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
from tqdm import tqdm

from kvstrata.engine.layer_capture import capture_layers
from kvstrata.errors import KvstrataError
from kvstrata.kv.attention_policy import AttentionPolicy, FullAttention
from kvstrata.kv.cache_factory import StorageLayout
from kvstrata.kv.impress.unread_tokens import SkipUnreadTokens
from kvstrata.kv.offload.full_offload import FullOffload
from kvstrata.kv.offload.h2o import H2OAttention
from kvstrata.kv.offload.host_pool import HostPoolCap
from kvstrata.kv.offload.infinigen import InfiniGenAttention
from kvstrata.kv.offload.link import parse_link
from kvstrata.kv.offload.skew import InfiniGenSkew, cached_skew_path, shipped_or_cached_skew, skew_from_windows
from kvstrata.kv.offload.transfers import OffloadStats
from kvstrata.kv.sliding_window import SlidingWindowAttention
from kvstrata.kv.window_blocks import window_in_force

DEFAULT_WINDOWS = 4
DEFAULT_WINDOW_TOKENS = 1024


def attention_policy(engine, layout: StorageLayout, num_slots: int) -> AttentionPolicy:
    c, mc = engine.config, engine.loaded.config
    if window_in_force(mc.sliding_window, engine.max_model_len) is not None:
        return _sliding_window(engine)
    if c.kv_offload == "none":
        if c.prefix_loading != "full":  # a prefix loaded by importance leaves tokens some layers never read
            return SkipUnreadTokens(engine.kv_cache, num_slots)
        return FullAttention(engine.kv_cache)
    stats = OffloadStats(mc.num_layers, parse_link(c.kv_link))
    row_bytes = layout.bytes_per_token / (mc.num_layers * mc.num_kv_heads)
    if c.kv_offload == "full":
        return FullOffload(engine.kv_cache, engine.device, row_bytes, stats, compiled_kernels=c.paged_kernel)
    if c.kv_offload == "h2o":
        return H2OAttention(engine.kv_cache, c.h2o_budget, num_slots, stats)
    cap = None
    if c.kv_host_memory is not None:
        if c.kv_host_memory < layout.bytes_per_token:
            raise KvstrataError(f"kv_host_memory of {c.kv_host_memory} bytes holds no token; a token's K and V take "
                                f"{layout.bytes_per_token:g} bytes in this format, so give at least that")
        cap = HostPoolCap(int(c.kv_host_memory // layout.bytes_per_token), c.kv_host_eviction, mc.num_layers,
                          num_slots, c.block_size, engine.kv_cache.device)
    return InfiniGenAttention(engine.kv_cache, engine.device, row_bytes, stats, infinigen_skew_for(engine),
                              engine.loaded.model.layer_queries, c.infinigen_settings(), num_slots, cap,
                              compiled_kernels=c.paged_kernel)


def _sliding_window(engine) -> SlidingWindowAttention:
    """The model's sliding window, for an engine that serves contexts past it; the policies that choose a layer's
    keys themselves (offload, a prefix loaded by importance) attend beyond any window, so they are refused there."""
    c, window = engine.config, engine.loaded.config.sliding_window
    for option, value, plain in (("kv_offload", c.kv_offload, "none"), ("prefix_loading", c.prefix_loading, "full")):
        if value != plain:
            raise KvstrataError(f"{option} {value!r} does not read a sliding window; this model's is {window} tokens "
                                f"and max_model_len {engine.max_model_len} passes it: give {option} {plain!r} or "
                                f"max_model_len {window} or less")
    return SlidingWindowAttention(engine.kv_cache, window)


def infinigen_skew_for(engine) -> InfiniGenSkew:
    """The named skew file, else the model's shipped or cached skew, else one calibrated now on the packaged text
    (Emma) and cached for the next run."""
    if engine.config.infinigen_calibration:
        return InfiniGenSkew.load(engine.config.infinigen_calibration, engine.model_fingerprint)
    skew = shipped_or_cached_skew(engine.model_fingerprint)
    if skew is not None:
        return skew
    if engine.tokenizer is None:
        raise KvstrataError("infinigen needs a skew for this model, and a model without a tokenizer cannot be "
                            "calibrated on the packaged text; calibrate it on token ids with "
                            "kvstrata.engine.kv_offload_setup.calibrate_skew and pass --infinigen-calibration")
    from kvstrata.data import EMMA

    twin = type(engine)(dataclasses.replace(engine.config, kv_offload="none"), loaded=engine.loaded)
    skew = calibrate_skew(twin, twin.tokenize(EMMA.read_text(encoding="utf-8")), source=EMMA.name)
    try:
        skew.save(cached_skew_path(engine.model_fingerprint))
    except KvstrataError as exc:  # the skew is still good for this run
        warnings.warn(f"{exc}; the infinigen skew will be calibrated again next time", stacklevel=2)
    return skew


def calibrate_skew(engine, token_ids: list[int], windows: int = DEFAULT_WINDOWS,
                   window_tokens: int = DEFAULT_WINDOW_TOKENS, progress: bool = True, source: str = "") -> InfiniGenSkew:
    """The skew of `windows` windows of `window_tokens` tokens spread evenly over `token_ids` (an engine whose KV
    stays on the device)."""
    window_tokens = min(window_tokens, engine.max_model_len)
    if windows < 1 or len(token_ids) < window_tokens:
        raise KvstrataError(f"infinigen calibration needs at least one window of {window_tokens} tokens; got "
                            f"{windows} windows from {len(token_ids)} tokens")
    starts = np.linspace(0, len(token_ids) - window_tokens, windows).astype(int).tolist()
    captured = [capture_layers(engine, token_ids[s : s + window_tokens])
                for s in tqdm(starts, desc="calibrating infinigen", disable=not progress)]
    captured = [(window["q"], window["k"]) for window in captured]
    return skew_from_windows(captured, engine.model_fingerprint, window_tokens, source)
