"""Builds the paged KV cache for `--kv-format`: full precision in a float dtype, or a quantized format."""

from __future__ import annotations

import torch

from kvstrata.kv.formats.base import KVFormat
from kvstrata.kv.formats.integer import Int4Format, Int8Format
from kvstrata.kv.paged_attention import PagedAttention
from kvstrata.kv.paged_cache import PagedKVCache
from kvstrata.kv.quantized_cache import QuantizedPagedKVCache

FLOAT_FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_kv_format(name: str, engine) -> KVFormat:
    """A quantized format for the engine's model (Oaken loads or makes the model's calibration)."""
    mc = engine.loaded.config
    width = mc.num_kv_heads * mc.head_dim
    if name == "int8":
        return Int8Format(width)
    if name == "int4":
        return Int4Format(width)
    from kvstrata.kv.formats.oaken.format import oaken_format_for

    return oaken_format_for(engine)


class KVCacheLayout:
    """What one token costs and how to build the cache, for a format chosen by name."""

    def __init__(self, name: str | None, engine, model_dtype: torch.dtype):
        mc = engine.loaded.config
        self.shape = (mc.num_layers, mc.num_kv_heads, mc.head_dim)
        self.dtype = model_dtype if name is None else FLOAT_FORMATS.get(name)  # None: quantized
        self.format = None if self.dtype is not None else make_kv_format(name, engine)

    @property
    def bytes_per_token(self) -> float:
        num_layers, heads, head_dim = self.shape
        if self.format is None:
            return PagedKVCache.bytes_per_token(num_layers, heads, head_dim, self.dtype)
        return QuantizedPagedKVCache.bytes_per_token(self.format, num_layers)

    def build(self, num_blocks: int, block_size: int, device: torch.device) -> PagedAttention:
        num_layers, heads, head_dim = self.shape
        if self.format is None:
            return PagedKVCache(num_layers, num_blocks, block_size, heads, head_dim, self.dtype, device)
        return QuantizedPagedKVCache(self.format, num_layers, num_blocks, block_size, heads, head_dim, device)
