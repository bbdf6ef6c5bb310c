"""Builds the paged KV cache for `--kv-format`: full precision in a float dtype, a per-token quantized
format, or KIVI."""

from __future__ import annotations

import torch

from kvstrata.kv.formats.base import KVFormat
from kvstrata.kv.formats.integer import Int4Format, Int8Format
from kvstrata.kv.kivi_cache import KiviPagedKVCache
from kvstrata.kv.paged_attention import PagedAttention
from kvstrata.kv.paged_cache import PagedKVCache
from kvstrata.kv.quantized_cache import QuantizedPagedKVCache

FLOAT_FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KIVI_FORMATS = {"kivi4": 4, "kivi2": 2}


def make_kv_format(name: str, engine) -> KVFormat:
    """A quantized format for the engine's model (Oaken loads or makes the model's calibration)."""
    mc = engine.loaded.config
    width = mc.num_kv_heads * mc.head_dim
    if name == "int8":
        return Int8Format(width)
    if name == "int4":
        return Int4Format(width, engine.config.int4_group_size)
    from kvstrata.kv.formats.oaken.format import oaken_format_for

    return oaken_format_for(engine)


class KVCacheLayout:
    """What the cache costs (bytes per token, memory reserved up front) and how to build it, for a
    format chosen by name."""

    def __init__(self, name: str | None, engine, model_dtype: torch.dtype):
        mc, c = engine.loaded.config, engine.config
        self.shape = (mc.num_layers, mc.num_kv_heads, mc.head_dim)
        self.block_size = c.block_size
        self.kivi_bits = KIVI_FORMATS.get(name)
        self.dtype = model_dtype if name is None else FLOAT_FORMATS.get(name)
        self.format = None if self.dtype is not None or self.kivi_bits else make_kv_format(name, engine)
        self.kivi_residual = c.kivi_residual
        # KIVI's full-precision window: every running sequence's newest blocks, plus one step's prefill chunk
        window_blocks = -(-c.kivi_residual // c.block_size) + 1
        self.window_slots = c.max_num_seqs * window_blocks + -(-c.chunk_size // c.block_size) + 1

    @property
    def bytes_per_token(self) -> float:
        num_layers, heads, head_dim = self.shape
        if self.kivi_bits:
            return KiviPagedKVCache.bytes_per_token(self.kivi_bits, heads * head_dim, self.block_size, num_layers)
        if self.format is None:
            return PagedKVCache.bytes_per_token(num_layers, heads, head_dim, self.dtype)
        return QuantizedPagedKVCache.bytes_per_token(self.format, num_layers)

    @property
    def reserved_bytes(self) -> int:
        """Memory taken from the budget before blocks are counted (KIVI's full-precision window)."""
        if not self.kivi_bits:
            return 0
        num_layers, heads, head_dim = self.shape
        per_token = KiviPagedKVCache.window_bytes_per_token(heads * head_dim, num_layers)
        return self.window_slots * self.block_size * per_token

    def build(self, num_blocks: int, device: torch.device) -> PagedAttention:
        num_layers, heads, head_dim = self.shape
        if self.kivi_bits:
            return KiviPagedKVCache(self.kivi_bits, self.kivi_residual, num_layers, num_blocks, self.block_size,
                                    heads, head_dim, device, self.window_slots)
        if self.format is None:
            return PagedKVCache(num_layers, num_blocks, self.block_size, heads, head_dim, self.dtype, device)
        return QuantizedPagedKVCache(self.format, num_layers, num_blocks, self.block_size, heads, head_dim, device)
