"""How a tier stores one layer's K or V of a chunk: raw floats (the compute dtype, exact), float16, or a
CacheGen level (papers/cachegen.md; kvstrata/cachegen/codec.py), one layer per object so a loader can
read a subset of layers. The `levels` form writes a chunk once in each of float16 and the CacheGen levels,
so a loader streaming it picks the level of every chunk as the link allows (CacheGen §4).

Each object names its form in its header (`StoredForm.name`: float32, float16, bfloat16 or a level), so a
reader decodes whatever form a chunk was written in, whichever form it writes itself.
"""

from __future__ import annotations

import dataclasses
import struct
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from kvstrata.cachegen.codec import decode_tensor, encode_tensor
from kvstrata.cachegen.levels import CACHEGEN_LEVELS, settings_for
from kvstrata.cachegen.quantize import layer_bins
from kvstrata.errors import KvstrataError
from kvstrata.kv.store.errors import CorruptObject

if TYPE_CHECKING:  # the profile module calibrates by running the model; a form only reads a profile's steps
    from kvstrata.cachegen.profile import CodecProfile

FLOAT_FORMS = {"raw": None, "fp16": torch.float16}  # raw: the dtype the K/V were computed in
LEVELS_FORM = "levels"
STORE_FORMS = (*FLOAT_FORMS, *CACHEGEN_LEVELS, LEVELS_FORM)  # what --kv-store-format takes
STREAMED_LEVELS = ("float16", *CACHEGEN_LEVELS)  # what the levels form writes, best quality first
FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # as written
_SECTION = struct.Struct("<HI")  # name length, data length


class StoredForm(ABC):
    name: str

    @abstractmethod
    def encode(self, x: torch.Tensor, kind: str, layer: int, num_layers: int) -> bytes:
        """Bytes of x [tokens, kv_heads, head_dim], the `kind` ("k" or "v") of `layer`."""

    @abstractmethod
    def decode(self, payload: bytes, shape: tuple[int, ...], kind: str, layer: int, num_layers: int) -> torch.Tensor:
        """x [tokens, kv_heads, head_dim] (float32) back from `encode`'s bytes; CorruptObject if they do not fit."""


class FloatForm(StoredForm):
    def __init__(self, dtype: torch.dtype):
        self.name, self.dtype = str(dtype).removeprefix("torch."), dtype

    def encode(self, x, kind, layer, num_layers):
        return x.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()

    def decode(self, payload, shape, kind, layer, num_layers):
        expected = self.dtype.itemsize * _count(shape)
        if len(payload) != expected:
            raise CorruptObject(f"a {self.name} object of shape {shape} holds {len(payload)} bytes, expected {expected}")
        x = torch.frombuffer(bytearray(payload), dtype=self.dtype).reshape(shape).float()
        if not torch.isfinite(x).all():
            raise CorruptObject(f"a {self.name} object holds NaN or inf values")
        return x


class CacheGenForm(StoredForm):
    """One layer coded alone, and one coder model for its anchors and one for the rest, counted per object.
    Per-(layer, channel) models would ship one count table and cost one coder call per channel in every
    256-token object; decoding is on the time-to-first-token path. With the model's profile, the layer's
    steps come from its sensitivity (the steps travel in the object, so a reader needs no profile); without
    one, the level's bin for the layer's third."""

    def __init__(self, level: str, profile: CodecProfile | None = None, profiled: bool = False):
        """`profile`: the model's, to write with steps from its sensitivity; `profiled` alone: to read what such a
        writer wrote (K is then coded directly)."""
        self.name = level
        profiled = profiled or profile is not None
        self.settings = dataclasses.replace(settings_for(level, profiled=profiled), models="global")
        self.steps = ({kind: getattr(profile, kind).steps(self.settings.bins[0]) for kind in ("k", "v")}
                      if profile is not None else None)

    def _layer_settings(self, layer: int, num_layers: int):
        step = float(layer_bins(self.settings.bins, num_layers)[layer])
        return dataclasses.replace(self.settings, bins=(step, step, step))

    def encode(self, x, kind, layer, num_layers):
        tokens, heads, dim = x.shape
        steps = tuple(part[layer : layer + 1] for part in self.steps[kind]) if self.steps else None
        sections = encode_tensor(x.reshape(1, tokens, heads * dim), self._layer_settings(layer, num_layers), kind,
                                 steps=steps)
        return b"".join(_SECTION.pack(len(n), len(d)) + n.encode() + d for n, d in sections.items())

    def decode(self, payload, shape, kind, layer, num_layers):
        if len(shape) != 3:
            raise CorruptObject(f"a {self.name} object has shape {shape}, expected (tokens, kv_heads, head_dim)")
        sections, offset = {}, 0
        while offset < len(payload):
            if offset + _SECTION.size > len(payload):
                raise CorruptObject(f"a {self.name} object ends inside a section header")
            name_len, data_len = _SECTION.unpack_from(payload, offset)
            offset += _SECTION.size
            if offset + name_len + data_len > len(payload):
                raise CorruptObject(f"a {self.name} object ends inside a section")
            name = payload[offset : offset + name_len].decode("ascii", "replace")
            sections[name] = payload[offset + name_len : offset + name_len + data_len]
            offset += name_len + data_len
        tokens, heads, dim = shape
        try:
            x = decode_tensor(sections, self._layer_settings(layer, num_layers), (1, tokens, heads * dim), kind)
        except Exception as exc:  # the checksum held, so this is a stream of another codec version
            raise CorruptObject(f"a {self.name} object could not be decoded: {type(exc).__name__}: {exc}") from exc
        if not torch.isfinite(x).all():
            raise CorruptObject(f"a {self.name} object decodes to NaN or inf values")
        return x.reshape(shape)


class LeveledForm:
    """A chunk written in every one of STREAMED_LEVELS (a tier keeps each level's objects apart and a manifest
    of their sizes: tiered_store.py), so a loader can fetch each chunk at the level the link allows."""

    name = LEVELS_FORM

    def __init__(self, profile: CodecProfile | None = None):
        self.levels: list[StoredForm] = [FloatForm(torch.float16),
                                         *(CacheGenForm(level, profile) for level in CACHEGEN_LEVELS)]


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def stored_form(name: str, compute_dtype: torch.dtype,
                profile: CodecProfile | None = None) -> StoredForm | LeveledForm:
    """The form `--kv-store-format` names (raw is the compute dtype); CacheGen levels take their steps from
    the model's profile's sensitivity when given."""
    if name == LEVELS_FORM:
        return LeveledForm(profile)
    if name in FLOAT_FORMS:
        return FloatForm(FLOAT_FORMS[name] or compute_dtype)
    if name in CACHEGEN_LEVELS:
        return CacheGenForm(name, profile)
    raise KvstrataError(f"kv_store_format {name!r} is not one of {', '.join(STORE_FORMS)}")


def written_form(name: str, profiled: bool = False) -> StoredForm:
    """The form an object's header names, as an engine whose model has a profile (`profiled`) or none writes it;
    CorruptObject if no such form exists."""
    if name in FLOAT_DTYPES:
        return FloatForm(FLOAT_DTYPES[name])
    if name in CACHEGEN_LEVELS:
        return CacheGenForm(name, profiled=profiled)
    raise CorruptObject(f"an object names the stored form {name!r}, which this version does not know")


def parse_tier_forms(spec: str, tier_names: list[str]) -> list[str]:
    """`--kv-store-format` per tier: one form for every tier ("raw") or TIER=FORM pairs ("host=raw,redis=medium";
    tiers not named store raw)."""
    parts = [part.strip() for part in str(spec).split(",")]
    if len(parts) == 1 and "=" not in parts[0]:
        stored_form(parts[0], torch.float32)
        return [parts[0]] * len(tier_names)
    chosen = {}
    for part in parts:
        tier, _, form = part.partition("=")
        if not form or tier not in ("host", "disk", "redis"):
            raise KvstrataError(f"kv_store_format part {part!r} is not FORM or TIER=FORM with TIER one of host, disk, "
                                f"redis (e.g. host=raw,redis=medium)")
        stored_form(form, torch.float32)
        chosen[tier] = form
    missing = set(chosen) - set(tier_names)
    if tier_names and missing:
        raise KvstrataError(f"kv_store_format names the tiers {sorted(missing)}, which kv_store does not have")
    return [chosen.get(name, "raw") for name in tier_names]
