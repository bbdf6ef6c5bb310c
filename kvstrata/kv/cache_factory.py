"""The registry of KV formats (`--kv-format`): each name gives a layout that says what a token costs the
budget, how the pool's blocks are grouped, and builds the storage. K and V may be in two record formats, named
KEYS/VALUES (e.g. int8/int4: kv/formats/split.py).

Formats that need something made above kv/ (Oaken's calibrated thresholds) receive it through
`FormatOptions.oaken_format`, so kv/ never reaches into the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv.formats.base import KVFormat
from kvstrata.kv.formats.float8 import Float8Format
from kvstrata.kv.formats.integer import Int4Format, Int8Format
from kvstrata.kv.formats.records import RecordFormat
from kvstrata.kv.formats.split import SplitFormat
from kvstrata.kv.kivi_cache import KiviPagedKVCache, blocks_per_slot, slots_a_step_adds, slots_per_sequence
from kvstrata.kv.paged_cache import PagedKVCache
from kvstrata.kv.quantized_cache import QuantizedPagedKVCache
from kvstrata.kv.storage import KVStorage


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def width(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class FormatOptions:
    int4_group_size: int = 64
    kivi_residual: int = 128
    chunk_size: int = 1024  # the most new tokens a step writes: what it may add to KIVI's window
    oaken_format: Callable[[], KVFormat] | None = None  # resolves the model's calibration (engine/kv_setup.py)
    in_place_decode: bool = True  # decodes on the CPU: the compiled decode-attention kernels where they build
    cascade_min_tokens: int = 0  # ... which read a prefix this long that the decodes share once for all (0: never)


class StorageLayout(ABC):
    def __init__(self, shape: CacheShape):
        self.shape = shape

    @property
    @abstractmethod
    def bytes_per_token(self) -> float:
        """What one token costs the KV budget."""

    @property
    def block_group(self) -> int:
        """The pool's blocks come in aligned groups of this many (KIVI's window borrows them whole): the number of
        blocks is a multiple of it."""
        return 1

    @property
    def blocks_beside_a_sequence(self) -> int:
        """Blocks a lone sequence may need besides its own (KIVI's window)."""
        return 0

    @abstractmethod
    def build(self, num_blocks: int, device: torch.device) -> KVStorage: ...


class FloatLayout(StorageLayout):
    def __init__(self, shape: CacheShape, dtype: torch.dtype, options: FormatOptions):
        super().__init__(shape)
        self.dtype = dtype
        self.options = options

    @property
    def bytes_per_token(self) -> float:
        s = self.shape
        return PagedKVCache.bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype)

    def build(self, num_blocks, device) -> KVStorage:
        s = self.shape
        return PagedKVCache(s.num_layers, num_blocks, s.block_size, s.num_kv_heads, s.head_dim, self.dtype, device,
                            self.options.in_place_decode, self.options.cascade_min_tokens)


class QuantizedLayout(StorageLayout):
    def __init__(self, shape: CacheShape, kv_format: KVFormat, options: FormatOptions):
        super().__init__(shape)
        self.format = kv_format
        self.options = options

    @property
    def bytes_per_token(self) -> float:
        return QuantizedPagedKVCache.bytes_per_token(self.format, self.shape.num_layers)

    def build(self, num_blocks, device) -> KVStorage:
        s = self.shape
        return QuantizedPagedKVCache(self.format, s.num_layers, num_blocks, s.block_size, s.num_kv_heads, s.head_dim,
                                     device, self.options.in_place_decode, self.options.cascade_min_tokens)


class KiviLayout(StorageLayout):
    def __init__(self, shape: CacheShape, bits: int, options: FormatOptions):
        super().__init__(shape)
        self.bits, self.residual, self.chunk_size = bits, options.kivi_residual, options.chunk_size
        self.in_place_decode = options.in_place_decode

    @property
    def bytes_per_token(self) -> float:
        s = self.shape
        return KiviPagedKVCache.bytes_per_token(self.bits, s.width, s.block_size, s.num_layers)

    @property
    def block_group(self) -> int:
        return blocks_per_slot(self.bits)

    @property
    def blocks_beside_a_sequence(self) -> int:
        """A sequence's float16 window and what a step adds, each slot a group of blocks."""
        slots = slots_per_sequence(self.residual, self.shape.block_size) + slots_a_step_adds(self.chunk_size,
                                                                                             self.residual)
        return slots * self.block_group

    def build(self, num_blocks, device) -> KVStorage:
        s = self.shape
        return KiviPagedKVCache(self.bits, self.residual, s.num_layers, num_blocks, s.block_size, s.num_kv_heads,
                                s.head_dim, device, self.chunk_size, self.in_place_decode)


def _oaken(shape: CacheShape, options: FormatOptions) -> StorageLayout:
    if options.oaken_format is None:
        raise KvstrataError("kv_format 'oaken' needs the model's calibration; build it with the engine")
    return QuantizedLayout(shape, options.oaken_format(), options)


# the formats of per-token records (kv/formats/records.py): each a cache's format alone, or one side of a split one
RECORD_FORMATS: dict[str, Callable[[CacheShape, FormatOptions], RecordFormat]] = {
    "int8": lambda shape, options: Int8Format(shape.width),
    "int4": lambda shape, options: Int4Format(shape.width, options.int4_group_size),
    "fp8": lambda shape, options: Float8Format(shape.width, "fp8"),
    "fp8_e5m2": lambda shape, options: Float8Format(shape.width, "fp8_e5m2"),
}


def _records(name: str) -> Callable[[CacheShape, FormatOptions], StorageLayout]:
    return lambda shape, options: QuantizedLayout(shape, RECORD_FORMATS[name](shape, options), options)


KV_FORMATS: dict[str, Callable[[CacheShape, FormatOptions], StorageLayout]] = {
    "fp32": lambda shape, options: FloatLayout(shape, torch.float32, options),
    "fp16": lambda shape, options: FloatLayout(shape, torch.float16, options),
    "bf16": lambda shape, options: FloatLayout(shape, torch.bfloat16, options),
    **{name: _records(name) for name in RECORD_FORMATS},
    "kivi4": lambda shape, options: KiviLayout(shape, 4, options),
    "kivi2": lambda shape, options: KiviLayout(shape, 2, options),
    "oaken": _oaken,
}
FLOAT_FORMAT_OF_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def split_sides(name: str) -> tuple[str, str] | None:
    """The (keys, values) formats a KEYS/VALUES name gives, None for any other name; a side that is not a record
    format is refused with what is allowed."""
    keys, slash, values = name.partition("/")
    if not slash:
        return None
    for side, what in ((keys, "K"), (values, "V")):
        if side not in RECORD_FORMATS:
            raise KvstrataError(f"kv_format {name!r}: {what}'s format {side!r} is not one of "
                                f"{', '.join(RECORD_FORMATS)} (K and V in two formats, KEYS/VALUES, take those)")
    return keys, values


def check_kv_format(name: str) -> None:
    """Refuses, naming what is allowed, a name that is neither a format nor KEYS/VALUES of two record formats."""
    if name not in KV_FORMATS and split_sides(name) is None:
        raise KvstrataError(f"kv_format {name!r} is not one of {', '.join(KV_FORMATS)}, or KEYS/VALUES of two of "
                            f"{', '.join(RECORD_FORMATS)} (e.g. int8/int4)")


def storage_layout(name: str, shape: CacheShape, options: FormatOptions) -> StorageLayout:
    check_kv_format(name)
    sides = split_sides(name)
    if sides is None:
        return KV_FORMATS[name](shape, options)
    keys, values = (RECORD_FORMATS[side](shape, options) for side in sides)
    return QuantizedLayout(shape, SplitFormat(keys, values), options)
