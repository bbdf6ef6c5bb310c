"""Coder models profiled offline once per model (papers/cachegen.md §2.3, the §5.2 reading).

For every (layer, channel) of K and of V, the anchor differences divided by their layer's RMS are
fitted with a Laplace distribution (location = median, scale = mean absolute deviation), averaged
over the calibration windows; anchors get one histogram per layer. A chunk then only ships each
group's symbol range, and the model is the profile discretized at the level's bin with a small
floor, so symbols the profile never saw stay codable.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvstrata.cachegen.entropy import SymbolModel, symbol_range
from kvstrata.cachegen.errors import CorruptStreamError, ForeignModelError
from kvstrata.cachegen.quantize import (
    ANCHOR_LEVELS,
    GROUP_SIZE,
    differences_from_anchors,
    layer_bins,
    quantize_cachegen,
)
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.errors import KvstrataError

PROFILE_FORMAT = "kvstrata-cachegen-profile"
PROFILE_VERSION = 1
FLOOR = 1e-6  # probability mass spread over every symbol of a group's range


@dataclass
class TensorProfile:
    loc: np.ndarray  # [L, C], in units of the layer's difference RMS
    scale: np.ndarray  # [L, C]
    anchor_counts: np.ndarray  # [L, 2 * ANCHOR_LEVELS + 1]

    def models_for(self, groups: list[np.ndarray], bins) -> list[SymbolModel]:
        return self.models_for_ranges(np.array([symbol_range(g) for g in groups]), bins)

    def models_for_ranges(self, ranges: np.ndarray, bins) -> list[SymbolModel]:
        num_layers, channels = self.loc.shape
        if len(ranges) != num_layers * (channels + 1):
            raise CorruptStreamError(f"{len(ranges)} symbol ranges do not fit a profile of {num_layers} layers")
        layer_bin = layer_bins(bins, num_layers).numpy()
        models = []
        for index, (lo, hi) in enumerate(ranges.tolist()):
            layer, slot = divmod(index, channels + 1)
            symbols = np.arange(lo, hi + 1, dtype=np.float64)
            if slot == 0:
                inside = np.clip(symbols + ANCHOR_LEVELS, 0, 2 * ANCHOR_LEVELS).astype(np.int64)
                mass = self.anchor_counts[layer][inside] / max(self.anchor_counts[layer].sum(), 1)
            else:
                mass = _laplace_mass(symbols, layer_bin[layer], self.loc[layer, slot - 1], self.scale[layer, slot - 1])
            mass = mass + FLOOR
            models.append(SymbolModel(lo, mass / mass.sum()))
        return models


def _laplace_mass(symbols: np.ndarray, bin_size: float, loc: float, scale: float) -> np.ndarray:
    def cdf(x):
        z = (x - loc) / scale
        return np.where(z < 0, 0.5 * np.exp(np.minimum(z, 0)), 1 - 0.5 * np.exp(-np.maximum(z, 0)))

    return cdf((symbols + 0.5) * bin_size) - cdf((symbols - 0.5) * bin_size)


@dataclass
class CodecProfile:
    fingerprint: str
    k: TensorProfile
    v: TensorProfile
    num_windows: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        meta = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "fingerprint": self.fingerprint,
                "num_windows": self.num_windows, "group_size": GROUP_SIZE}
        arrays = {f"{kind}_{name}": getattr(getattr(self, kind), name)
                  for kind in ("k", "v") for name in ("loc", "scale", "anchor_counts")}
        np.savez_compressed(buffer, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        return buffer.getvalue()

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: str | Path, fingerprint: str) -> CodecProfile:
        try:
            with np.load(path) as data:
                meta = json.loads(bytes(data["meta"]).decode())
                arrays = {name: data[name] for name in data.files if name != "meta"}
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            raise CorruptStreamError(f"{path} is not a CacheGen profile: {exc}") from None
        if meta.get("format") != PROFILE_FORMAT or meta.get("version") != PROFILE_VERSION:
            raise CorruptStreamError(f"{path} is not a version-{PROFILE_VERSION} CacheGen profile")
        if meta.get("fingerprint") != fingerprint:
            raise ForeignModelError(
                f"the profile {path} was made for model {meta.get('fingerprint')}, not the loaded model {fingerprint}"
            )
        profiles = {kind: TensorProfile(arrays[f"{kind}_loc"], arrays[f"{kind}_scale"], arrays[f"{kind}_anchor_counts"])
                    for kind in ("k", "v")}
        return cls(fingerprint, profiles["k"], profiles["v"], int(meta["num_windows"]))


class ProfileBuilder:
    """Accumulates windows of K or V [L, T, C] into a TensorProfile."""

    def __init__(self):
        self.locs, self.scales, self.anchor_counts = [], [], None

    def add(self, x: torch.Tensor) -> None:
        num_layers = x.shape[0]
        symbols = quantize_cachegen(x.float(), torch.ones(num_layers))  # bin 1: differences in RMS units
        anchors_hat = symbols.anchors.float() * symbols.anchor_scale.float()[:, None]
        normalized = differences_from_anchors(x.float(), anchors_hat) / symbols.step[:, None, None]
        loc = normalized.median(dim=1).values
        self.locs.append(loc)
        self.scales.append((normalized - loc[:, None]).abs().mean(dim=1).clamp_min(1e-3))
        counts = torch.stack([
            torch.bincount(symbols.anchors[layer].reshape(-1) + ANCHOR_LEVELS, minlength=2 * ANCHOR_LEVELS + 1)
            for layer in range(num_layers)
        ])
        self.anchor_counts = counts if self.anchor_counts is None else self.anchor_counts + counts

    def build(self) -> TensorProfile:
        return TensorProfile(
            torch.stack(self.locs).mean(0).numpy().astype(np.float32),
            torch.stack(self.scales).mean(0).numpy().astype(np.float32),
            self.anchor_counts.numpy().astype(np.int64),
        )



def calibrate(engine, token_ids: list[int], windows: int, window_tokens: int, progress: bool = True) -> CodecProfile:
    """Profile the coder models over `windows` windows of `window_tokens` tokens spread over `token_ids`."""
    if windows < 1 or window_tokens < 2 * GROUP_SIZE or len(token_ids) < window_tokens:
        raise KvstrataError(
            f"calibration needs at least one window of at least {2 * GROUP_SIZE} tokens from a text that long; got "
            f"{windows} windows of {window_tokens} tokens from {len(token_ids)} tokens"
        )
    starts = np.linspace(0, len(token_ids) - window_tokens, windows).astype(int)
    builders = {"k": ProfileBuilder(), "v": ProfileBuilder()}
    for start in tqdm(starts, desc="calibrating cachegen", disable=not progress):
        k, v = compute_kv(engine, token_ids[start : start + window_tokens])
        for name, x in (("k", k), ("v", v)):
            builders[name].add(x.reshape(x.shape[0], x.shape[1], -1))
    return CodecProfile(engine.model_fingerprint, builders["k"].build(), builders["v"].build(), len(starts))
