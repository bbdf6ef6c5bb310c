"""Coder models fitted per chunk: each coder group's symbols as a discretized Gaussian, its mean and spread in the
stream.

A chunk's counted models (entropy.counted_model) ship one count table per group, which a KV store object of one
layer and 256 tokens cannot afford per channel, so it used to share one table across all its channels. But a
transform's components (transform.py) differ in spread by orders of magnitude, and one model for all of them
costs far more than a model per component (docs/BENCHMARKS.md, "Fitted coder models"). A fitted model costs five
bytes per group before deflation: the group's mean in quarters of a symbol, and its spread (the RMS about that
mean) as a code, 2 ** (code / SPREAD_CODE_STEPS). Groups that share a spread code and a mean's fraction share one
model and are coded one after another, so a chunk builds a few tens of models, not one per channel. Both sides
compute a model from its code alone, with the same double arithmetic.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.cachegen.entropy import SymbolModel
from kvstrata.cachegen.errors import CorruptStreamError

SPREAD_CODE_STEPS = 4  # a spread code is a quarter octave: a model at most 9% too wide or narrow
SPREAD_CODES = (-16, 64)  # spreads from 1/16 of a symbol (a constant group) to 2^16 symbols
MEAN_STEPS = 4  # a mean is coded in quarters of a symbol
MAX_REACH = 1 << 20  # the farthest a symbol may lie from its group's mean
_PARAMETERS = np.dtype([("mean", "<i4"), ("spread", "i1")])


@dataclass(frozen=True)
class FittedModels:
    means: np.ndarray  # int64 [groups]: each group's mean, in 1 / MEAN_STEPS of a symbol
    spreads: np.ndarray  # int64 [groups]: each group's spread code
    reach: int  # a power of two at least every |symbol - mean|: every model covers [-reach, reach]

    @classmethod
    def fit(cls, groups: list[np.ndarray]) -> FittedModels:
        sizes = np.array([g.size for g in groups], dtype=np.int64)
        flat = np.concatenate([g.reshape(-1) for g in groups] or [np.zeros(0)]).astype(np.float64)
        owner = np.repeat(np.arange(len(groups)), sizes)
        counts = np.maximum(sizes, 1)
        means = np.round(MEAN_STEPS * np.bincount(owner, flat, len(groups)) / counts).astype(np.int64)
        centered = flat - np.repeat(means / MEAN_STEPS, sizes)
        rms = np.sqrt(np.bincount(owner, centered * centered, len(groups)) / counts)
        spreads = np.round(SPREAD_CODE_STEPS * np.log2(np.maximum(rms, 2.0 ** (SPREAD_CODES[0] / SPREAD_CODE_STEPS))))
        farthest = float(np.abs(centered).max(initial=0.0)) + 1
        if farthest > MAX_REACH:
            raise ValueError(f"a coder group's symbols lie {farthest:.0f} from its mean, beyond the fitted models' "
                             f"{MAX_REACH}")
        return cls(means, np.clip(spreads, *SPREAD_CODES).astype(np.int64), 1 << math.ceil(math.log2(farthest)))

    def to_bytes(self) -> bytes:
        """The reach (int32), then each group's mean (int32) and spread code (int8), deflated."""
        parameters = np.empty(len(self.means), dtype=_PARAMETERS)
        parameters["mean"], parameters["spread"] = self.means, self.spreads
        return zlib.compress(np.int32(self.reach).astype("<i4").tobytes() + parameters.tobytes(), 6)

    @classmethod
    def from_bytes(cls, data: bytes, num_groups: int) -> FittedModels:
        try:
            raw = zlib.decompress(data)
        except zlib.error as exc:
            raise CorruptStreamError(f"the fitted models do not inflate: {exc}") from None
        if len(raw) != 4 + num_groups * _PARAMETERS.itemsize:
            raise CorruptStreamError(f"the fitted models hold {len(raw)} bytes, expected "
                                     f"{4 + num_groups * _PARAMETERS.itemsize} for {num_groups} groups")
        reach = int(np.frombuffer(raw[:4], dtype="<i4")[0])
        parameters = np.frombuffer(raw[4:], dtype=_PARAMETERS)
        spreads = parameters["spread"].astype(np.int64)
        if (not 1 <= reach <= MAX_REACH or reach & (reach - 1)
                or ((spreads < SPREAD_CODES[0]) | (spreads > SPREAD_CODES[1])).any()):
            raise CorruptStreamError(f"the fitted models' reach {reach} or spread codes lie outside what a writer "
                                     f"writes (a power of two to {MAX_REACH}; codes {SPREAD_CODES[0]} to "
                                     f"{SPREAD_CODES[1]})")
        return cls(parameters["mean"].astype(np.int64), spreads, reach)

    def coded(self, groups: list[np.ndarray]) -> tuple[list[np.ndarray], list[SymbolModel]]:
        """The symbols to code, one run per model (each group less its mean's whole part), and each run's model."""
        order, starts, models = self._runs
        offsets = np.floor_divide(self.means, MEAN_STEPS)
        runs = [np.concatenate([groups[i].reshape(-1).astype(np.int64) - offsets[i] for i in members])
                for members in np.split(order, starts[1:])]
        return runs, models

    def runs(self, sizes: list[int]) -> tuple[list[int], list[SymbolModel]]:
        """For a decoder: each run's size (the groups' `sizes` given), and its model."""
        order, starts, models = self._runs
        return np.add.reduceat(np.asarray(sizes, dtype=np.int64)[order], starts).tolist() if len(order) else [], models

    def groups_from_runs(self, flat: np.ndarray, sizes: list[int]) -> np.ndarray:
        """The decoded runs `flat` back as every group's symbols, in group order, concatenated."""
        sizes = np.asarray(sizes, dtype=np.int64)
        order = self._runs[0]
        coded_start = np.empty(len(sizes), dtype=np.int64)
        coded_start[order] = np.cumsum(sizes[order]) - sizes[order]
        shift = coded_start - (np.cumsum(sizes) - sizes)
        return flat[np.arange(int(sizes.sum())) + np.repeat(shift, sizes)] + np.repeat(
            np.floor_divide(self.means, MEAN_STEPS).astype(flat.dtype), sizes)

    @functools.cached_property
    def _runs(self) -> tuple[np.ndarray, np.ndarray, list[SymbolModel]]:
        """The groups in the order they are coded (by model: spread code and mean's fraction, in their own order
        within one model), where each model's run starts in that order, and the runs' models."""
        keys = self.spreads * MEAN_STEPS + np.mod(self.means, MEAN_STEPS)
        order = np.argsort(keys, kind="stable")
        starts = np.flatnonzero(np.diff(keys[order], prepend=keys[order][:1] - 1))
        models = [SymbolModel(-self.reach, gaussian_table(int(key) // MEAN_STEPS, int(key) % MEAN_STEPS, self.reach))
                  for key in keys[order][starts]]
        return order, starts, models


@functools.lru_cache(maxsize=1024)
def gaussian_table(spread: int, fraction: int, reach: int) -> np.ndarray:
    """Probabilities of the integers -reach ... reach under a Gaussian about fraction / MEAN_STEPS of RMS
    2 ** (spread / SPREAD_CODE_STEPS), each the mass of its unit bin (the coder gives every symbol some frequency,
    so a table may be all but zero far out). Read-only: shared through the cache."""
    sigma = 2.0 ** (spread / SPREAD_CODE_STEPS)
    edges = torch.arange(-reach, reach + 2, dtype=torch.float64) - 0.5 - fraction / MEAN_STEPS
    cdf = 0.5 * torch.erf(edges / (sigma * math.sqrt(2.0)))
    mass = (cdf[1:] - cdf[:-1]).clamp_min(0.0).numpy()
    table = mass / mass.sum() if mass.sum() > 0 else np.full(len(mass), 1.0 / len(mass))
    table.flags.writeable = False
    return table
