"""How a tier stores one layer's K or V of a chunk: raw floats (the compute dtype, exact), float16, or a
CacheGen level (papers/cachegen.md; kvstrata/cachegen/codec.py), one layer per object so a loader can
read a subset of layers. The `levels` form writes a chunk once in each of float16 and the CacheGen levels,
so a loader streaming it picks the level of every chunk as the link allows (CacheGen §4).

Each object names its form in its header (`StoredForm.name`: float32, float16, bfloat16, a level, or a level
coded over each KV head's decorrelated components, "<level>+transform"), so a reader decodes whatever form a
chunk was written in, whichever form it writes itself. The transform (kvstrata/cachegen/transform.py) needs the
chunk's first position (keys are coded before RoPE) and the model's profile to decode; a chunk whose tokens are
not in order (a reordered IMPRESS node's) is coded over its channels.
"""

from __future__ import annotations

import dataclasses
import struct
from abc import ABC, abstractmethod
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from kvstrata.cachegen.codec import anchors_first_token, decode_tensor, encode_tensor, from_components
from kvstrata.cachegen.levels import CACHEGEN_LEVELS, COMPONENT_LEVELS, CodecSettings, settings_for
from kvstrata.cachegen.quantize import layer_bins
from kvstrata.errors import KvstrataError
from kvstrata.kv.store.errors import CorruptObject

if TYPE_CHECKING:  # the profile module calibrates by running the model; a form only reads a profile's steps
    from kvstrata.cachegen.profile import CodecProfile
    from kvstrata.cachegen.transform import ChannelTransform

FLOAT_FORMS = {"raw": None, "fp16": torch.float16}  # raw: the dtype the K/V were computed in
LEVELS_FORM = "levels"
STORE_FORMS = (*FLOAT_FORMS, *CACHEGEN_LEVELS, LEVELS_FORM)  # what --kv-store-format takes
STREAMED_LEVELS = ("float16", *CACHEGEN_LEVELS)  # what the levels form writes, best quality first
FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # as written
TRANSFORM_SUFFIX = "+transform"  # of a level coded over each KV head's decorrelated components
_SECTION = struct.Struct("<HI")  # name length, data length


class StoredForm(ABC):
    name: str

    def at(self, position: int | None) -> StoredForm:
        """The form this one writes a chunk in whose first token sits at `position` in its context (None: the
        chunk's tokens are not in order)."""
        return self

    @abstractmethod
    def encode(self, x: torch.Tensor, kind: str, layer: int, num_layers: int, position: int | None = None) -> bytes:
        """Bytes of x [tokens, kv_heads, head_dim], the `kind` ("k" or "v") of `layer`, first token at `position`."""

    @abstractmethod
    def decode(self, payload: bytes, shape: tuple[int, ...], kind: str, layer: int, num_layers: int,
               position: int | None = None) -> torch.Tensor:
        """x [tokens, kv_heads, head_dim] (float32) back from `encode`'s bytes; CorruptObject if they do not fit."""

    def decode_layers(self, payloads: dict[int, bytes], shape: tuple[int, ...], kind: str, num_layers: int,
                      position: int | None = None) -> torch.Tensor:
        """[len(payloads), tokens, kv_heads, head_dim]: the objects of one chunk's layers (layer -> payload, in
        order), as `decode` gives each."""
        return torch.stack([self.decode(payload, shape, kind, layer, num_layers, position)
                            for layer, payload in payloads.items()])


class FloatForm(StoredForm):
    def __init__(self, dtype: torch.dtype):
        self.name, self.dtype = str(dtype).removeprefix("torch."), dtype

    def encode(self, x, kind, layer, num_layers, position=None):
        return x.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()

    def decode(self, payload, shape, kind, layer, num_layers, position=None):
        expected = self.dtype.itemsize * _count(shape)
        if len(payload) != expected:
            raise CorruptObject(f"a {self.name} object of shape {shape} holds {len(payload)} bytes, expected {expected}")
        x = torch.frombuffer(bytearray(payload), dtype=self.dtype).reshape(shape).float()
        if not _all_finite(x):
            raise CorruptObject(f"a {self.name} object holds NaN or inf values")
        return x


class CacheGenForm(StoredForm):
    """One layer coded alone, with a coder model fitted per channel or component (cachegen/fitted_models.py: a
    count table per channel would cost more than the symbols it saves in a 256-token object), and an 8-bit anchor
    only in a context's first chunk, whose first token is the attention sink. With the model's profile, the
    layer's steps come from its sensitivity (the steps travel in the object, so a reader needs no profile unless
    the object is coded over transformed components); without one, the level's bin for the layer's third."""

    def __init__(self, level: str, profile: CodecProfile | None = None, profiled: bool = False,
                 transform: bool = False):
        """`profile`: the model's, to write with steps from its sensitivity, and to write or read components of
        its transforms (`transform`); `profiled` alone: to read what such a writer wrote over channels (K is then
        coded directly)."""
        if transform and (profile is None or not profile.has_transforms):
            raise ValueError("a CacheGen form coded over transformed components needs a profile holding transforms")
        self.name = level + (TRANSFORM_SUFFIX if transform else "")
        self.level, self.profile = level, profile
        self.settings = dataclasses.replace(
            settings_for(level, profiled=profiled or profile is not None, transform=transform),
            models="layer-channel", source="fitted", sink_anchor_only=True)

    def at(self, position):
        if (position is None or self.settings.transform or self.profile is None or not self.profile.has_transforms
                or self.level not in COMPONENT_LEVELS):
            return self
        return self._transformed

    @cached_property
    def _transformed(self) -> CacheGenForm:
        return CacheGenForm(self.level, self.profile, transform=True)

    @cached_property
    def _steps(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """Layer steps and channel codes per kind, from the profile's sensitivity (None without a profile)."""
        if self.profile is None:
            return None
        bin_size = self.settings.bins[0]
        return {kind: (getattr(self.profile, kind).component_steps(bin_size) if self.settings.transform
                       else getattr(self.profile, kind).steps(bin_size)) for kind in ("k", "v")}

    def _layer_settings(self, layer: int, num_layers: int, coded: bool = False) -> CodecSettings:
        """The settings `layer` is written with; `coded`: as its symbols are read (without the transform, which
        decode_layers undoes for all layers at once). Kept: settings check themselves as they are made, which
        would cost as much as a small object's symbols."""
        key = (layer, num_layers, coded)
        if key not in self._settings_of_layers:
            step = float(layer_bins(self.settings.bins, num_layers)[layer])
            self._settings_of_layers[key] = dataclasses.replace(
                self.settings, bins=(step, step, step), transform=self.settings.transform and not coded)
        return self._settings_of_layers[key]

    @cached_property
    def _settings_of_layers(self) -> dict[tuple[int, int, bool], CodecSettings]:
        return {}

    def _layer_transform(self, kind: str, first: int, end: int) -> ChannelTransform:
        return getattr(self.profile, kind).transform.layers(first, end)

    def encode(self, x, kind, layer, num_layers, position=None):
        tokens, heads, dim = x.shape
        steps = tuple(part[layer : layer + 1] for part in self._steps[kind]) if self._steps else None
        coding = {}
        if self.settings.transform:
            if position is None:
                raise ValueError(f"a {self.name} object is written at its chunk's position (StoredForm.at)")
            coding = {"transform": self._layer_transform(kind, layer, layer + 1)}
        sections = encode_tensor(x.reshape(1, tokens, heads * dim), self._layer_settings(layer, num_layers), kind,
                                 steps=steps, first_position=_coded_position(position), **coding)
        return b"".join(_SECTION.pack(len(n), len(d)) + n.encode() + d for n, d in sections.items())

    def decode(self, payload, shape, kind, layer, num_layers, position=None):
        return self.decode_layers({layer: payload}, shape, kind, num_layers, position)[0]

    def decode_layers(self, payloads, shape, kind, num_layers, position=None):
        """Over components, the symbols of every object first, then one inverse transform for all its layers
        (per object, its small products would cost as much as decoding the symbols)."""
        if len(shape) != 3:
            raise CorruptObject(f"a {self.name} object has shape {shape}, expected (tokens, kv_heads, head_dim)")
        tokens, heads, dim = shape
        layers = list(payloads)
        if self.settings.transform and (position is None or layers != list(range(layers[0], layers[-1] + 1))):
            raise CorruptObject(f"{self.name} objects of layers {layers} at position {position} cannot be decoded "
                                f"together: they need a position and consecutive layers")
        coded = []
        for layer, payload in payloads.items():
            settings = self._layer_settings(layer, num_layers, coded=True)
            sections = self._sections(payload)
            try:
                coded.append(decode_tensor(sections, settings, (1, tokens, heads * dim), kind,
                                           first_position=_coded_position(position)))
            except Exception as exc:  # the checksum held, so this is a stream of another codec version
                raise CorruptObject(f"a {self.name} object could not be decoded: {type(exc).__name__}: {exc}") from exc
        x = torch.cat(coded)
        if self.settings.transform:
            try:
                x = from_components(x, self._layer_transform(kind, layers[0], layers[-1] + 1), position,
                                    anchors_first_token(self.settings, position))
            except (ValueError, RuntimeError) as exc:  # layers or heads the profile does not have
                raise CorruptObject(f"{self.name} objects do not fit the profile's transforms: {exc}") from exc
        if not _all_finite(x):
            raise CorruptObject(f"a {self.name} object decodes to NaN or inf values")
        return x.reshape(len(layers), tokens, heads, dim)

    def _sections(self, payload: bytes) -> dict[str, bytes]:
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
        return sections


class LeveledForm:
    """A chunk written in every one of STREAMED_LEVELS (a tier keeps each level's objects apart and a manifest
    of their sizes: tiered_store.py), so a loader can fetch each chunk at the level the link allows."""

    name = LEVELS_FORM

    def __init__(self, profile: CodecProfile | None = None):
        self.levels: list[StoredForm] = [FloatForm(torch.float16),
                                         *(CacheGenForm(level, profile) for level in CACHEGEN_LEVELS)]

    def at(self, position: int | None) -> LeveledForm:
        """Itself: each level takes the chunk's position as it writes (StoredForm.at)."""
        return self


def _coded_position(position: int | None) -> int:
    """The position a chunk's symbols are coded at: its own, or 0 for a chunk whose tokens are not in order (None),
    which may hold a context's first token anywhere, so its first token keeps its 8-bit anchor."""
    return 0 if position is None else position


def _all_finite(x: torch.Tensor) -> bool:
    """Whether x holds no NaN or inf, in one pass (a sum that overflows counts as not: values that large are not
    a cache's)."""
    return bool(torch.isfinite(x.sum()))


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


def written_form(name: str, profile: CodecProfile | None = None) -> StoredForm:
    """The form an object's header names, as an engine with the model's profile `profile` (or none) writes it;
    CorruptObject if no such form exists or it needs transforms the profile lacks."""
    if name in FLOAT_DTYPES:
        return FloatForm(FLOAT_DTYPES[name])
    level = name.removesuffix(TRANSFORM_SUFFIX)
    if level in CACHEGEN_LEVELS and name == level:
        return CacheGenForm(level, profiled=profile is not None)
    if level in COMPONENT_LEVELS:
        if profile is None or not profile.has_transforms:
            raise CorruptObject(f"an object in the form {name!r} needs the model's profile with transforms to decode")
        return CacheGenForm(level, profile, transform=True)
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
