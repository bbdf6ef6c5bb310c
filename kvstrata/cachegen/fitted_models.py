"""Coder models fitted per chunk: each coder group's symbols as a discretized Gaussian, its mean and spread in the
stream.

A chunk's counted models (entropy.counted_model) ship one count table per group, which a KV store object of one
layer and 256 tokens cannot afford per channel, so it used to share one table across all its channels. But a
transform's components (transform.py) differ in spread by orders of magnitude, and one model for all of them
costs far more than a model per component (docs/BENCHMARKS.md, "Fitted coder models in the KV store").

A fitted model costs five bytes per group before deflation: the group's mean in quarters of a symbol, and its
spread (the RMS about that mean) as a code, 2 ** (code / SPREAD_CODE_STEPS). Groups that share a spread code and a
mean's fraction share one model (the coder builds each once: entropy.py), so a chunk builds a few tens of models,
not one per channel. Each model covers the symbols its groups reach (a power of two each side, one byte per
model), so a narrow one is a short table.

Both sides compute a model from its codes alone, in float64. A reader whose erf differed in the last bit could
build another table; its stream would then all but surely fail the coder's final-state check, and the object be
dropped as corrupt.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvstrata.cachegen.entropy import SymbolModel
from kvstrata.cachegen.errors import CorruptStreamError

SPREAD_CODE_STEPS = 4  # a spread code is a quarter octave: a model at most 9% too wide or narrow
SPREAD_CODES = (-16, 64)  # spreads from 1/16 of a symbol (a constant group) to 2^16 symbols
MEAN_STEPS = 4  # a mean is coded in quarters of a symbol
MAX_REACH_BITS = 16  # a symbol lies at most 2^16 from the whole part of its group's mean
MAX_TABLE_ENTRIES = 1 << 22  # of all of a chunk's models together: a corrupt stream cannot ask for more memory
CACHED_REACH = 1 << 10  # tables up to this reach are kept for the next chunk
_PARAMETERS = np.dtype([("mean", "<i4"), ("spread", "i1")])


class CoderModels(NamedTuple):
    models: list[SymbolModel]  # one per (spread code, mean's fraction) the groups have
    group_models: np.ndarray  # int64 [groups]: each group's model, an index into `models`


@dataclass(frozen=True)
class FittedModels:
    means: np.ndarray  # int64 [groups]: each group's mean, in 1 / MEAN_STEPS of a symbol
    spreads: np.ndarray  # int64 [groups]: each group's spread code
    reach_bits: np.ndarray  # int64 [models]: model m covers [-2^bits, 2^bits] about its groups' means' whole parts

    @classmethod
    def fit(cls, groups: list[np.ndarray]) -> FittedModels:
        sizes = np.array([g.size for g in groups], dtype=np.int64)
        flat = np.concatenate([g.reshape(-1) for g in groups] or [np.zeros(0)]).astype(np.float64)
        owner = np.repeat(np.arange(len(groups)), sizes)
        counts = np.maximum(sizes, 1)
        means = np.round(MEAN_STEPS * np.bincount(owner, flat, len(groups)) / counts).astype(np.int64)
        if np.abs(means).max(initial=0) >= 2**31:
            raise ValueError("a coder group's mean lies beyond what 32 bits hold in quarters of a symbol")
        centered = flat - np.repeat(means / MEAN_STEPS, sizes)
        rms = np.sqrt(np.bincount(owner, centered * centered, len(groups)) / counts)
        spreads = np.round(SPREAD_CODE_STEPS * np.log2(np.maximum(rms, 2.0 ** (SPREAD_CODES[0] / SPREAD_CODE_STEPS))))
        spreads = np.clip(spreads, *SPREAD_CODES).astype(np.int64)
        _, group_models = _model_keys(means, spreads)
        farthest = np.zeros(int(group_models.max(initial=-1)) + 1)
        whole_means = np.repeat(np.floor_divide(means, MEAN_STEPS), sizes)
        np.maximum.at(farthest, group_models[owner], np.abs(flat - whole_means))
        fitted = cls(means, spreads, np.ceil(np.log2(farthest + 1)).astype(np.int64))
        if problem := fitted._too_wide():
            raise ValueError(f"a chunk's symbols are too spread for fitted models: {problem}")
        return fitted

    def to_bytes(self) -> bytes:
        """Each group's mean (int32) and spread code (int8), then each model's reach bits (uint8), deflated."""
        parameters = np.empty(len(self.means), dtype=_PARAMETERS)
        parameters["mean"], parameters["spread"] = self.means, self.spreads
        return zlib.compress(parameters.tobytes() + self.reach_bits.astype(np.uint8).tobytes(), 6)

    @classmethod
    def from_bytes(cls, data: bytes, num_groups: int) -> FittedModels:
        try:
            raw = zlib.decompress(data)
        except zlib.error as exc:
            raise CorruptStreamError(f"the fitted models do not inflate: {exc}") from None
        group_bytes = num_groups * _PARAMETERS.itemsize
        if len(raw) < group_bytes:
            raise CorruptStreamError(f"the fitted models hold {len(raw)} bytes, too few for {num_groups} groups")
        parameters = np.frombuffer(raw[:group_bytes], dtype=_PARAMETERS)
        means, spreads = parameters["mean"].astype(np.int64), parameters["spread"].astype(np.int64)
        if ((spreads < SPREAD_CODES[0]) | (spreads > SPREAD_CODES[1])).any():
            raise CorruptStreamError(f"a fitted model's spread code lies outside {SPREAD_CODES[0]} to "
                                     f"{SPREAD_CODES[1]}")
        fitted = cls(means, spreads, np.frombuffer(raw[group_bytes:], dtype=np.uint8).astype(np.int64))
        num_models = len(fitted._keys[0])
        if len(fitted.reach_bits) != num_models:
            raise CorruptStreamError(f"the fitted models give {len(fitted.reach_bits)} reaches for {num_models} "
                                     f"models")
        if problem := fitted._too_wide():
            raise CorruptStreamError(f"the fitted models are wider than a writer writes: {problem}")
        return fitted

    def offsets(self) -> np.ndarray:
        """What each group's symbols are coded less: the whole part of its mean."""
        return np.floor_divide(self.means, MEAN_STEPS)

    @functools.cached_property
    def coder_models(self) -> CoderModels:
        keys, group_models = self._keys
        models = [SymbolModel(-(1 << int(bits)), gaussian_table(int(key) // MEAN_STEPS, int(key) % MEAN_STEPS,
                                                                1 << int(bits)))
                  for key, bits in zip(keys, self.reach_bits)]
        return CoderModels(models, group_models)

    @functools.cached_property
    def _keys(self) -> tuple[np.ndarray, np.ndarray]:
        return _model_keys(self.means, self.spreads)

    def _too_wide(self) -> str | None:
        """What exceeds MAX_REACH_BITS or MAX_TABLE_ENTRIES, if anything."""
        if (self.reach_bits > MAX_REACH_BITS).any():
            return f"a model reaches 2^{int(self.reach_bits.max())} symbols, beyond 2^{MAX_REACH_BITS}"
        entries = int((2 * (1 << self.reach_bits) + 1).sum())
        if entries > MAX_TABLE_ENTRIES:
            return f"the models' tables hold {entries} entries, beyond {MAX_TABLE_ENTRIES}"
        return None


def _model_keys(means: np.ndarray, spreads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (spread code, mean's fraction) keys, sorted, and each group's index among them."""
    keys, group_models = np.unique(spreads * MEAN_STEPS + np.mod(means, MEAN_STEPS), return_inverse=True)
    return keys, group_models.astype(np.int64).reshape(-1)


def gaussian_table(spread: int, fraction: int, reach: int) -> np.ndarray:
    """Probabilities of the integers -reach ... reach under a Gaussian about fraction / MEAN_STEPS of RMS
    2 ** (spread / SPREAD_CODE_STEPS), each the mass of its unit bin (the coder gives every symbol some frequency,
    so a table may be all but zero far out). Read-only: narrow tables are shared through a cache."""
    return _cached_table(spread, fraction, reach) if reach <= CACHED_REACH else _table(spread, fraction, reach)


@functools.lru_cache(maxsize=4096)
def _cached_table(spread: int, fraction: int, reach: int) -> np.ndarray:
    return _table(spread, fraction, reach)


def _table(spread: int, fraction: int, reach: int) -> np.ndarray:
    sigma = 2.0 ** (spread / SPREAD_CODE_STEPS)
    edges = torch.arange(-reach, reach + 2, dtype=torch.float64) - 0.5 - fraction / MEAN_STEPS
    cdf = 0.5 * torch.erf(edges / (sigma * math.sqrt(2.0)))
    mass = (cdf[1:] - cdf[:-1]).clamp_min(0.0).numpy()
    table = mass / mass.sum() if mass.sum() > 0 else np.full(len(mass), 1.0 / len(mass))
    table.flags.writeable = False
    return table
