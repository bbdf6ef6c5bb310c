"""Coder models profiled offline once per model (papers/cachegen.md §2.3, the §5.2 reading).

For every (layer, channel) of K and of V, the anchor differences divided by their layer's RMS are
fitted with a Laplace distribution (location = median, scale = mean absolute deviation), averaged
over the calibration windows; anchors get one histogram per layer. The same is fitted to the values
themselves (in the same unit) for tensors coded without differences. A chunk then only ships each
group's symbol range, and the model is the profile discretized at the level's bin with a small
floor, so symbols the profile never saw stay codable.

The profile also records, per (layer, channel) of K and of V, how much an error costs the tokens that
read the cache (sensitivity.py) and each layer's mean RMS; the sensitivity levels set their steps from
them (quantize.py, "Steps from sensitivity"). From version 5 it also holds each KV head's decorrelating
transform of K and of V (transform.py), fitted on the same windows as the coder models.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import zipfile
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
    channel_multipliers,
    differences_from_anchors,
    quantize_cachegen,
    steps_from_sensitivity,
)
from kvstrata.cachegen.sensitivity import measure_sensitivity
from kvstrata.cachegen.transform import ChannelTransform, MomentBuilder, transform_weights
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.errors import KvstrataError
from kvstrata.model.config import LLAMA_FAMILY
from kvstrata.model.rotary import rope_inverse_frequencies

PROFILE_FORMAT = "kvstrata-cachegen-profile"
SHIPPED_PROFILES = Path(__file__).parent / "profiles"  # <model fingerprint>.npz, made by `kvstrata calibrate cachegen`
PROFILE_VERSION = 5  # 3: key importance; 4: sensitivity of K and V and each layer's RMS instead; 5: transforms
READABLE_VERSIONS = (4, 5)  # a version-4 profile has no transforms
FIT_NAMES = ("loc", "scale", "anchor_counts")
TENSOR_NAMES = ("sigma", "sensitivity")
FLOOR = 1e-6  # probability mass spread over every symbol of a group's range


@dataclass
class SymbolFit:
    loc: np.ndarray  # [L, C], in units of the layer's difference RMS
    scale: np.ndarray  # [L, C]
    anchor_counts: np.ndarray  # [L, 2 * ANCHOR_LEVELS + 1]


@dataclass
class TensorProfile:
    differences: SymbolFit  # for coding as anchor differences
    direct: SymbolFit  # for coding the values themselves
    sigma: np.ndarray  # [L]: each layer's anchor-difference RMS, the unit of the fits and of bins
    sensitivity: np.ndarray  # [L, C]: mean squared loss gradient per cached value (sensitivity.py)
    transform: ChannelTransform | None = None  # each KV head's decorrelating transform (transform.py)

    def steps(self, bin_size: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer steps [L] and channel codes [L, C] from the sensitivity, scaled so that the steps' geometric
        mean in units of each layer's RMS is `bin_size`."""
        return steps_from_sensitivity(torch.from_numpy(self.sensitivity), bin_size * self._unit())

    def component_steps(self, bin_size: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer steps [L] and channel codes [L, C] for the transform's components: one step for all, the
        sensitivity steps' in weighted units (transform.py), so that a bin costs about the same loss per value."""
        num_layers, channels = self.sensitivity.shape
        return (torch.full((num_layers,), bin_size * self._unit(), dtype=torch.float32),
                torch.zeros(num_layers, channels, dtype=torch.int8))

    def _unit(self) -> float:
        """The geometric mean over (layer, channel) of RMS x sqrt(sensitivity): a value's typical size in weighted
        units."""
        return float(np.exp2(np.mean(np.log2(self.sigma)[:, None]
                                     + 0.5 * np.log2(np.maximum(self.sensitivity, 1e-30)))))

    def unit_bins(self, steps: torch.Tensor) -> torch.Tensor:
        """Absolute layer steps [L] in units of the profiled RMS (the bins of the profiled models)."""
        return steps / torch.from_numpy(self.sigma)

    def models_for(self, groups: list[np.ndarray], bins, differences: bool, channel_codes) -> list[SymbolModel]:
        return self.models_for_ranges(np.array([symbol_range(g) for g in groups]), bins, differences, channel_codes)

    def models_for_ranges(self, ranges: np.ndarray, bins, differences: bool, channel_codes) -> list[SymbolModel]:
        """Every group's model at once (one numpy pass over all symbols: a chunk has ~11,600 groups per tensor).
        `bins` [L]: each layer's step in RMS units; `channel_codes` [L, C]: the stream's per-channel step codes."""
        fit = self.differences if differences else self.direct
        num_layers, channels = fit.loc.shape
        if len(ranges) != num_layers * (channels + 1):
            raise CorruptStreamError(f"{len(ranges)} symbol ranges do not fit a profile of {num_layers} layers")
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        lengths = ranges[:, 1] - ranges[:, 0] + 1
        starts = np.cumsum(lengths) - lengths
        group = np.repeat(np.arange(len(ranges)), lengths)
        symbols = (ranges[group, 0] + np.arange(lengths.sum()) - starts[group]).astype(np.float64)
        layer, slot = np.divmod(group, channels + 1)
        anchor = slot == 0
        mass = np.empty(len(symbols))
        inside = np.clip(symbols[anchor] + ANCHOR_LEVELS, 0, 2 * ANCHOR_LEVELS).astype(np.int64)
        totals = np.maximum(fit.anchor_counts.sum(axis=1), 1)
        mass[anchor] = fit.anchor_counts[layer[anchor], inside] / totals[layer[anchor]]
        rest, channel = layer[~anchor], slot[~anchor] - 1
        bin_sizes = (bins[:, None] * channel_multipliers(channel_codes)).numpy()
        mass[~anchor] = _laplace_mass(symbols[~anchor], bin_sizes[rest, channel].astype(np.float64),
                                      fit.loc[rest, channel], fit.scale[rest, channel])
        mass += FLOOR
        mass /= np.add.reduceat(mass, starts)[group]
        return [SymbolModel(int(lo), probabilities)
                for lo, probabilities in zip(ranges[:, 0], np.split(mass, starts[1:]))]


def _laplace_mass(symbols: np.ndarray, bin_size, loc, scale) -> np.ndarray:
    """Probability of each symbol's bin under a Laplace(loc, scale) (arrays broadcast element by element)."""
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

    @functools.cached_property
    def digest(self) -> str:
        """Of the serialized profile; kept, since serializing compresses megabytes of transforms."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]

    @property
    def has_transforms(self) -> bool:
        return self.k.transform is not None and self.v.transform is not None

    def to_bytes(self) -> bytes:
        """Version 5 with transforms, else version 4 (as written before transforms existed, so a version-4
        profile keeps its digest and the files coded with it still name it)."""
        if (self.k.transform is None) != (self.v.transform is None):
            raise ValueError("a profile holds transforms for both K and V or for neither")
        buffer = io.BytesIO()
        meta = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION if self.has_transforms else 4,
                "fingerprint": self.fingerprint, "num_windows": self.num_windows, "group_size": GROUP_SIZE}
        arrays = {f"{kind}_{coding}_{name}": getattr(getattr(getattr(self, kind), coding), name)
                  for kind in ("k", "v") for coding in ("differences", "direct") for name in FIT_NAMES}
        arrays.update({f"{kind}_{name}": getattr(getattr(self, kind), name) for kind in ("k", "v") for name in TENSOR_NAMES})
        if self.has_transforms:
            meta["rotary_keys"] = self.k.transform.inverse_frequencies is not None
            for kind in ("k", "v"):
                transform = getattr(self, kind).transform
                arrays.update({f"{kind}_transform_mean": transform.mean, f"{kind}_transform_rotation": transform.rotation})
            if meta["rotary_keys"]:
                arrays["k_transform_inverse_frequencies"] = self.k.transform.inverse_frequencies
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
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:  # ValueError covers bad JSON
            raise CorruptStreamError(f"{path} is not a CacheGen profile: {exc}") from None
        if meta.get("format") != PROFILE_FORMAT or meta.get("version") not in READABLE_VERSIONS:
            raise CorruptStreamError(f"{path} is not a CacheGen profile of version {' or '.join(map(str, READABLE_VERSIONS))}")
        if meta.get("fingerprint") != fingerprint:
            raise ForeignModelError(
                f"the profile {path} was made for model {meta.get('fingerprint')}, not the loaded model {fingerprint}"
            )
        try:
            profiles = {kind: TensorProfile(*(SymbolFit(*(arrays[f"{kind}_{coding}_{name}"] for name in FIT_NAMES))
                                              for coding in ("differences", "direct")),
                                            *(arrays[f"{kind}_{name}"] for name in TENSOR_NAMES))
                        for kind in ("k", "v")}
            if meta["version"] >= 5:
                frequencies = arrays["k_transform_inverse_frequencies"] if meta.get("rotary_keys") is True else None
                for kind, profile in profiles.items():
                    profile.transform = _stored_transform(path, arrays, kind, profile.sensitivity,
                                                          frequencies if kind == "k" else None)
        except KeyError as exc:
            raise CorruptStreamError(f"{path} lacks the array {exc}") from None
        return cls(fingerprint, profiles["k"], profiles["v"], int(meta["num_windows"]))


def _stored_transform(path, arrays: dict[str, np.ndarray], kind: str, sensitivity: np.ndarray,
                      frequencies: np.ndarray | None) -> ChannelTransform:
    """The `kind` transform of a version-5 profile, checked: a wrong one would decode every cache wrongly."""
    mean, rotation = arrays[f"{kind}_transform_mean"], arrays[f"{kind}_transform_rotation"]

    def require(condition: bool, problem: str) -> None:
        if not condition:
            raise CorruptStreamError(f"{path}: {problem}")

    require(mean.ndim == 3, f"{kind}_transform_mean has shape {mean.shape}, expected (layers, kv_heads, head_dim)")
    num_layers, num_heads, dim = mean.shape
    require(rotation.shape == (num_layers, num_heads, dim, dim),
            f"{kind}_transform_rotation has shape {rotation.shape}, expected {(num_layers, num_heads, dim, dim)}")
    require(sensitivity.shape == (num_layers, num_heads * dim),
            f"{kind}_sensitivity has shape {sensitivity.shape}, expected {(num_layers, num_heads * dim)}")
    require(frequencies is None or frequencies.shape == (dim // 2,),
            f"k_transform_inverse_frequencies has shape {getattr(frequencies, 'shape', None)}, expected {(dim // 2,)}")
    for name, array in ((f"{kind}_transform_mean", mean), (f"{kind}_transform_rotation", rotation),
                        ("k_transform_inverse_frequencies", frequencies), (f"{kind}_sensitivity", sensitivity)):
        require(array is None or np.isfinite(array).all(), f"{name} holds a non-finite number")
    per_head = sensitivity.reshape(num_layers, num_heads, dim)
    require(bool((per_head >= 0).all() and (per_head.max(axis=-1) > 0).all()),
            f"{kind}_sensitivity is negative somewhere or zero over a whole head")
    gram = np.einsum("lhdi,lhdj->lhij", rotation.astype(np.float64), rotation.astype(np.float64))
    require(float(np.abs(gram - np.eye(dim)).max()) < 1e-3, f"{kind}_transform_rotation is not orthogonal")
    weight = transform_weights(sensitivity, num_heads, frequencies is not None)
    return ChannelTransform(weight, mean.astype(np.float32), rotation.astype(np.float32), frequencies)


class _FitBuilder:
    """Averages one coding's Laplace fits over windows and sums its anchor histograms."""

    def __init__(self):
        self.locs, self.scales, self.anchor_counts = [], [], 0

    def add(self, normalized: torch.Tensor, anchors: torch.Tensor) -> None:
        loc = normalized.median(dim=1).values
        self.locs.append(loc)
        self.scales.append((normalized - loc[:, None]).abs().mean(dim=1).clamp_min(1e-3))
        self.anchor_counts = self.anchor_counts + torch.stack([
            torch.bincount(layer_anchors.reshape(-1) + ANCHOR_LEVELS, minlength=2 * ANCHOR_LEVELS + 1)
            for layer_anchors in anchors
        ])

    def build(self) -> SymbolFit:
        return SymbolFit(torch.stack(self.locs).mean(0).numpy().astype(np.float32),
                         torch.stack(self.scales).mean(0).numpy().astype(np.float32),
                         self.anchor_counts.numpy().astype(np.int64))


class ProfileBuilder:
    """Accumulates windows of K or V [L, T, C] into a TensorProfile."""

    def __init__(self, moments: MomentBuilder | None = None):
        """`moments`: to fit the tensor's transform as well (it needs the KV heads and RoPE's frequencies)."""
        self.fits = {True: _FitBuilder(), False: _FitBuilder()}  # keyed by `differences`
        self.sigmas = []
        self.moments = moments

    def add(self, x: torch.Tensor) -> None:
        x = x.float()
        bin_one = torch.ones(x.shape[0])  # bin 1: symbols before rounding are in RMS units
        for differences, fit in self.fits.items():
            symbols = quantize_cachegen(x, bin_one, differences)
            if differences:
                anchors_hat = symbols.anchors.float() * symbols.anchor_scale.float()[:, None]
                values = differences_from_anchors(x, anchors_hat)
                self.sigmas.append(symbols.step)
            else:
                values = x[:, 1:]
            fit.add(values / symbols.step[:, None, None], symbols.anchors)
        if self.moments is not None:
            self.moments.add(x)

    def build(self, sensitivity: np.ndarray) -> TensorProfile:
        sigma = torch.stack(self.sigmas).mean(0).numpy().astype(np.float32)
        sensitivity = sensitivity.astype(np.float32)
        transform = self.moments.build(sensitivity) if self.moments is not None else None
        return TensorProfile(self.fits[True].build(), self.fits[False].build(), sigma, sensitivity, transform)


def calibrate(engine, token_ids: list[int], windows: int, window_tokens: int, progress: bool = True,
              sensitivity_windows: int = 16, sensitivity_context: int = 1024, sensitivity_scored: int = 256
              ) -> CodecProfile:
    """Profile the coder models and the transforms over `windows` windows of `window_tokens` tokens spread over
    `token_ids`, and the sensitivity over `sensitivity_windows` windows of a context and the tokens scored after it."""
    if windows < 1 or window_tokens < 2 * GROUP_SIZE or len(token_ids) < window_tokens:
        raise KvstrataError(
            f"calibration needs at least one window of at least {2 * GROUP_SIZE} tokens from a text that long; got "
            f"{windows} windows of {window_tokens} tokens from {len(token_ids)} tokens"
        )
    starts = np.linspace(0, len(token_ids) - window_tokens, windows).astype(int)
    config = engine.loaded.config
    rotary = rope_inverse_frequencies(config).numpy() if config.architecture in LLAMA_FAMILY else None
    builders = {"k": ProfileBuilder(MomentBuilder(config.num_kv_heads, rotary)),
                "v": ProfileBuilder(MomentBuilder(config.num_kv_heads, None))}
    for start in tqdm(starts, desc="calibrating cachegen", disable=not progress):
        k, v = compute_kv(engine, token_ids[start : start + window_tokens])
        for name, x in (("k", k), ("v", v)):
            builders[name].add(x.reshape(x.shape[0], x.shape[1], -1))
    sensitivity_k, sensitivity_v = measure_sensitivity(engine, token_ids, sensitivity_windows, sensitivity_context,
                                                       sensitivity_scored)
    return CodecProfile(engine.model_fingerprint, builders["k"].build(sensitivity_k),
                        builders["v"].build(sensitivity_v), len(starts))


def shipped_profile(fingerprint: str, digest: str | None = None) -> CodecProfile | None:
    """The profile that ships with kvstrata for this model, if there is one; with `digest`, the shipped one of that
    digest if it was replaced by a newer one (SHIPPED_PROFILES/replaced/<fingerprint>-<digest>.npz, kept so that
    contexts saved with it still open), else the current one."""
    replaced = SHIPPED_PROFILES / "replaced" / f"{fingerprint}-{digest}.npz"
    path = replaced if digest is not None and replaced.exists() else SHIPPED_PROFILES / f"{fingerprint}.npz"
    return _read_shipped(path, fingerprint) if path.exists() else None


@functools.cache
def _read_shipped(path: Path, fingerprint: str) -> CodecProfile:
    """Once per process (every saved context opened asks for it). Callers share the object: nothing changes a
    profile once built."""
    return CodecProfile.load(path, fingerprint)
