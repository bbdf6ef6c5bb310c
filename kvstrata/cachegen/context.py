"""Saved contexts: prefill once, store the KV as CacheGen chunks, resume later without the prefill.

A context is cut into independent chunks of consecutive tokens (papers/cachegen.md §3), each
encoded at one or more levels. Loading decodes the chunks into `PreloadedKV` ranges that the
engine places in the paged cache; a chunk may instead be recomputed from its tokens on top of the
earlier chunks' decoded KV (the paper's text fallback).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.cachegen.bitstream import KVFile, KVFileHeader, ModelShape, Record, write_kv_file
from kvstrata.cachegen.codec import decode_tensor, encode_tensor
from kvstrata.cachegen.levels import ALL_LEVELS, CACHEGEN_LEVELS, CodecSettings, settings_for
from kvstrata.cachegen.profile import CodecProfile, shipped_profile
from kvstrata.cachegen.quantize import GROUP_SIZE
from kvstrata.cachegen.token_importance import observed_importance, token_codes
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.kv.preloaded import PreloadedKV

DEFAULT_CHUNK_TOKENS = 1536


def model_shape(engine: LLMEngine) -> ModelShape:
    mc = engine.loaded.config
    return ModelShape(engine.model_fingerprint, mc.num_layers, mc.num_kv_heads, mc.head_dim)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[L, T, H, D] -> [L, T, H * D]: a channel is one (head, dim) pair."""
    return x.reshape(x.shape[0], x.shape[1], -1)


def chunk_bounds(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < GROUP_SIZE:
        raise KvstrataError(f"chunk_tokens must be an integer of at least one token group ({GROUP_SIZE}), "
                            f"got {chunk_tokens!r}")
    return [(start, min(start + chunk_tokens, num_tokens)) for start in range(0, num_tokens, chunk_tokens)]


def _best_settings(level: str, profile: CodecProfile | None) -> CodecSettings:
    """With the model's profile, a CacheGen level's steps come from its sensitivity and each token's importance
    (over each KV head's decorrelated components where the profile holds transforms), and its coder models are
    counted per chunk; a model without a profile gets steps by layer third (measured:
    docs/BENCHMARKS.md, "CacheGen codec")."""
    settings = settings_for(level, profiled=profile is not None, token_steps=True,
                            transform=profile is not None and profile.has_transforms)
    if profile is None or settings.quantizer != "cachegen" or settings.models != "layer-channel" or settings.token_steps:
        return settings
    return dataclasses.replace(settings, source="profiled")


@dataclass
class SaveReport:
    path: Path
    num_tokens: int
    bytes: int
    prefill_seconds: float
    encode_seconds: float


def save_context(
    engine: LLMEngine,
    token_ids: list[int],
    path: str | Path,
    levels: list[str] | tuple[str, ...] = CACHEGEN_LEVELS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    profile: CodecProfile | None = None,
) -> SaveReport:
    """Prefill `token_ids` once and write every chunk at every level in `levels`. When a profile is given or
    ships for the model, CacheGen levels take their steps from its sensitivity and from the attention the
    context's last tokens pay each token (token_importance.py); otherwise the levels' layer-third steps."""
    profile = profile or shipped_profile(engine.model_fingerprint)
    settings = {level: _best_settings(level, profile) for level in levels}
    if not settings:
        raise KvstrataError("give at least one level to save")
    if any(s.source == "profiled" for s in settings.values()) and profile is None:
        raise KvstrataError("a profiled level needs a profile (kvstrata calibrate cachegen)")
    bounds = chunk_bounds(len(token_ids), chunk_tokens)
    start = time.perf_counter()
    k, v = compute_kv(engine, token_ids)
    prefilled = time.perf_counter()
    codes_by_kind = {}  # each token's step codes, for the levels with steps per token
    if any(s.token_steps for s in settings.values()):
        importance = observed_importance(engine, token_ids, k, v)
        codes_by_kind = {name: token_codes(importance, name) for name in ("k", "v")}
    records, payloads = [], []
    for index, (first, end) in enumerate(bounds):
        for level, codec in settings.items():
            sections = {}
            for name, x in (("k", k), ("v", v)):
                codes = codes_by_kind[name][:, first:end] if codec.token_steps else None
                encoded = encode_tensor(_flat(x[:, first:end]), codec, name, profile and getattr(profile, name),
                                        token_codes=codes, first_position=first)
                sections.update({f"{name}.{part}": data for part, data in encoded.items()})
            records.append(Record(index, level, codec, 0, {}, ""))
            payloads.append(sections)
    encoded_at = time.perf_counter()
    header = KVFileHeader(model_shape(engine), list(token_ids), bounds, profile.digest if profile else None, records)
    size = write_kv_file(path, header, payloads)
    return SaveReport(Path(path), len(token_ids), size, prefilled - start, encoded_at - prefilled)


class SavedContext:
    """A saved-context file checked against the loaded model."""

    def __init__(self, engine: LLMEngine, path: str | Path, profile: CodecProfile | None = None):
        self.file = KVFile.open(path)
        self.shape = model_shape(engine)
        self.file.check_model(self.shape)
        if self.file.header.profile is not None and profile is None:
            profile = shipped_profile(self.shape.fingerprint, self.file.header.profile)
        self.profile = profile
        if self.file.header.profile is not None and (profile is None or profile.digest != self.file.header.profile):
            raise KvstrataError(
                f"{path} was coded with the offline profile {self.file.header.profile}; load that profile to read it"
            )
        vocab = engine.loaded.config.vocab_size
        if max(self.token_ids) >= vocab:
            raise KvstrataError(f"{path} holds token id {max(self.token_ids)}, outside this model's vocabulary {vocab}")

    @property
    def token_ids(self) -> list[int]:
        return self.file.header.token_ids

    @property
    def chunk_bounds(self) -> list[tuple[int, int]]:
        return self.file.header.chunk_bounds

    @property
    def digest(self) -> bytes:
        return hashlib.blake2b(self.file.data, digest_size=16).digest()

    def best_level(self, chunk: int) -> str:
        """The best-quality level stored for `chunk` (levels are listed best first)."""
        stored = self.file.levels(chunk)
        for level in ALL_LEVELS:
            if level in stored:
                return level
        return stored[0]

    def decode_chunk(self, chunk: int, level: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, tokens, kv_heads, head_dim] of one chunk, float32."""
        record = self.file.record(chunk, level or self.best_level(chunk))
        first, end = self.chunk_bounds[chunk]
        shape = (self.shape.num_layers, end - first, self.shape.num_kv_heads * self.shape.head_dim)
        sections = self.file.sections(record)
        out = []
        for name in ("k", "v"):
            parts = {key.split(".", 1)[1]: data for key, data in sections.items() if key.startswith(f"{name}.")}
            profile = getattr(self.profile, name) if self.profile else None
            try:
                x = decode_tensor(parts, record.settings, shape, name, profile, first_position=first)
            except KeyError as exc:
                raise KvstrataError(f"chunk {chunk} at level {record.level} lacks section {name}.{exc}") from None
            out.append(x.reshape(self.shape.num_layers, end - first, self.shape.num_kv_heads, self.shape.head_dim))
        return out[0], out[1]

    def preloaded(self, level: str | None = None, recompute: set[int] | frozenset[int] = frozenset()) -> list[PreloadedKV]:
        """Decoded ranges for every chunk except those in `recompute`, which the engine prefills from
        their tokens on top of the earlier chunks' KV."""
        bad = set(recompute) - set(range(len(self.chunk_bounds)))
        if bad:
            raise KvstrataError(f"recompute chunks {sorted(bad)} do not exist; the context has {len(self.chunk_bounds)}")
        return [
            PreloadedKV(first, *self.decode_chunk(index, level))
            for index, (first, _) in enumerate(self.chunk_bounds)
            if index not in recompute
        ]



@dataclass
class ContextLoad:
    """What a request that continues a saved context starts with."""

    token_ids: list[int]
    preloaded: list[PreloadedKV]
    salt: bytes  # prefix-cache blocks built on this decoded KV are shared only with the same load

    @classmethod
    def prepare(cls, engine: LLMEngine, context, level: str | None, recompute) -> ContextLoad | None:
        if context is None:
            return None
        saved = context if isinstance(context, SavedContext) else SavedContext(engine, context)
        recompute = set(recompute)
        salt = hashlib.blake2b(saved.digest + repr((level, sorted(recompute))).encode(), digest_size=16).digest()
        return cls(saved.token_ids, saved.preloaded(level, recompute), salt)
