"""Codec settings and the named quality levels.

A level's bins are the quantization steps of the three layer thirds, in units of each layer's
anchor-difference RMS (papers/cachegen.md §2.2: coarser with depth). The paper's default level
uses bins 0.5 / 1 / 1.5; the others scale that shape. K is coded as differences from its group's
anchor and V directly (measured on the default model: docs/BENCHMARKS.md, "CacheGen codec"). Uniform levels are the FlexGen-style
baselines, bit-packed ("raw") or through the same entropy coder ("-ac").

Where the model has a profile (profile.py), a level's steps come from the profiled sensitivity instead
(quantize.py, "Steps from sensitivity"): SENSITIVITY_LEVELS, one bin each, the geometric mean of the
steps in units of the calibration text's RMS, K and V coded directly. Chosen on the tuning texts of
docs/BENCHMARKS.md ("Beyond Austen").

Saved contexts go one step further (IMPORTANCE_LEVELS, `token_steps`): each token's step also follows the
attention the context's last tokens pay it (token_importance.py), finer where later queries look. The bins
are those of the sensitivity levels over 0.75, so `medium` stays near its size; chosen on the tuning texts
(docs/BENCHMARKS.md, "Steps per token"). Where the profile holds transforms, saved contexts code each KV head's
decorrelated components instead of its channels (TRANSFORM_LEVELS, transform.py), and so do the KV store's
objects, without steps per token (COMPONENT_LEVELS).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from kvstrata.errors import KvstrataError

QUANTIZERS = ("cachegen", "uniform")
MODELS = ("layer-channel", "global", "raw")
DIFFERENCES = ("kv", "k", "none")
SOURCES = ("chunk", "profiled", "fitted")
ALLOCATIONS = ("thirds", "sensitivity")


@dataclass(frozen=True)
class CodecSettings:
    quantizer: str = "cachegen"
    bins: tuple[float, float, float] = (0.5, 1.0, 1.5)  # cachegen: steps of the first, middle, last layer third
    differences: str = "k"  # cachegen: which of K and V are coded as differences from their group's anchor
    bits: int = 8  # uniform: bits per value
    models: str = "layer-channel"  # one coder model per (layer, channel), one for everything, or no coder
    source: str = "chunk"  # models counted per chunk (shipped in the stream), profiled offline, or fitted per chunk
    allocation: str = "thirds"  # cachegen: steps by layer third (bins) or from the profiled sensitivity
    token_steps: bool = False  # cachegen: each token's step scaled by a code in the stream (its importance)
    transform: bool = False  # cachegen: each KV head's channels decorrelated first (transform.py; needs the profile)
    sink_anchor_only: bool = False  # cachegen: without differences, only a chunk at position 0 has an 8-bit anchor

    def __post_init__(self) -> None:
        _require(self.quantizer in QUANTIZERS, f"quantizer {self.quantizer!r} is not one of {QUANTIZERS}")
        _require(self.differences in DIFFERENCES, f"differences {self.differences!r} is not one of {DIFFERENCES}")
        _require(self.models in MODELS, f"models {self.models!r} is not one of {MODELS}")
        _require(self.source in SOURCES, f"source {self.source!r} is not one of {SOURCES}")
        _require(self.allocation in ALLOCATIONS, f"allocation {self.allocation!r} is not one of {ALLOCATIONS}")
        _require(
            len(self.bins) == 3 and all(isinstance(b, (int, float)) and 0 < b < 1e6 for b in self.bins),
            f"bins must be three positive numbers, got {self.bins!r}",
        )
        _require(isinstance(self.bits, int) and 2 <= self.bits <= 8, f"bits must be in [2, 8], got {self.bits!r}")
        for name in ("token_steps", "transform", "sink_anchor_only"):
            _require(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        _require(
            not self.sink_anchor_only or (self.quantizer == "cachegen" and self.differences != "kv"),
            f"sink_anchor_only needs the cachegen quantizer and a tensor coded without differences; got quantizer "
            f"{self.quantizer!r}, differences {self.differences!r}",
        )
        _require(self.models != "raw" or self.quantizer == "uniform", "only the uniform quantizer stores raw symbols")
        _require(
            self.allocation == "thirds" or (self.quantizer == "cachegen" and len(set(self.bins)) == 1),
            f"allocation 'sensitivity' needs the cachegen quantizer and one bin; got quantizer {self.quantizer!r}, "
            f"bins {self.bins!r}",
        )
        _require(
            self.source == "chunk" or (self.quantizer == "cachegen" and self.models == "layer-channel"),
            f"source {self.source!r} needs the cachegen quantizer and per-(layer, channel) models; got "
            f"quantizer {self.quantizer!r}, models {self.models!r}",
        )

        _require(
            not self.token_steps or (self.allocation == "sensitivity" and self.differences == "none"
                                     and self.source == "chunk"),
            f"token_steps needs allocation 'sensitivity', differences 'none' and source 'chunk'; got "
            f"{self.allocation!r}, {self.differences!r}, {self.source!r}",
        )
        _require(
            not self.transform or (self.allocation == "sensitivity" and self.differences == "none"
                                   and self.source in ("chunk", "fitted")),
            f"transform needs allocation 'sensitivity', differences 'none' and source 'chunk' or 'fitted'; got "
            f"{self.allocation!r}, {self.differences!r}, {self.source!r}",
        )

    def differences_for(self, kind: str) -> bool:
        """Whether the K ("k") or V ("v") tensor is coded as differences from anchors."""
        return kind in self.differences

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data) -> CodecSettings:
        if isinstance(data, dict) and "allocation" not in data:  # written before version 4: steps by layer third
            data = {**data, "allocation": "thirds"}
        if isinstance(data, dict) and "token_steps" not in data:  # written before steps per token existed
            data = {**data, "token_steps": False}
        if isinstance(data, dict) and "transform" not in data:  # written before transform coding existed
            data = {**data, "transform": False}
        if isinstance(data, dict) and "sink_anchor_only" not in data:  # written when every chunk had an anchor
            data = {**data, "sink_anchor_only": False}
        if not isinstance(data, dict) or set(data) != set(cls.__dataclass_fields__):
            raise KvstrataError(f"codec settings {data!r:.200} do not have the fields {sorted(cls.__dataclass_fields__)}")
        return cls(**{**data, "bins": tuple(data["bins"]) if isinstance(data["bins"], list) else data["bins"]})


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KvstrataError(message)


# Best quality first. Bins scale the paper's default shape 1 : 2 : 3.
LEVELS: dict[str, CodecSettings] = {
    "near-lossless": CodecSettings(bins=(0.05, 0.1, 0.15)),
    "high": CodecSettings(bins=(0.25, 0.5, 0.75)),
    "medium": CodecSettings(bins=(0.5, 1.0, 1.5)),
    "low": CodecSettings(bins=(1.0, 2.0, 3.0)),
}
CACHEGEN_LEVELS = tuple(LEVELS)
# The same names where the model has a profile: the same 1 : 5 : 10 : 20 spacing.
SENSITIVITY_LEVELS: dict[str, CodecSettings] = {
    name: CodecSettings(bins=(b, b, b), differences="none", allocation="sensitivity")
    for name, b in (("near-lossless", 0.075), ("high", 0.375), ("medium", 0.75), ("low", 1.5))
}
# The same names for saved contexts, whose tokens' steps follow their importance: bins over 0.75 (see above).
# Not near-lossless: it promises every token's precision (greedy output unchanged where the products do not round
# their activations, docs/DESIGN.md), which moving precision from some tokens to others would break.
IMPORTANCE_LEVELS: dict[str, CodecSettings] = {
    name: CodecSettings(bins=(b, b, b), differences="none", allocation="sensitivity", token_steps=True)
    for name, b in (("high", 0.5), ("medium", 1.0), ("low", 2.0))
}
# Where the profile holds each KV head's transform (version 5): the same, coded as decorrelated components
# (transform.py). One bin costs about the loss it did per value, but the components pack the variance into
# fewer symbols, so the bins are set for the sizes: medium at least 3.5x smaller than 8 bits on the tuning
# texts (docs/BENCHMARKS.md, "Transform coding").
TRANSFORM_LEVELS: dict[str, CodecSettings] = {
    name: replace(IMPORTANCE_LEVELS[name], bins=(b, b, b), transform=True)
    for name, b in (("high", 0.4), ("medium", 0.8), ("low", 1.6))
}
# The KV store's objects, coded when a chunk is computed (no later queries to weigh its tokens by): the
# sensitivity levels over components, without steps per token. Objects of one layer and 256 tokens lose more than
# saved contexts at a bin, so the bins were set on the same tuning texts for `medium` to stay within 1% of 8 bits
# there (docs/BENCHMARKS.md, "Transform coding in the KV store"). The store codes them with fitted coder models and
# an anchor only in a context's first chunk (kv/store/forms.py).
COMPONENT_LEVELS: dict[str, CodecSettings] = {
    name: replace(SENSITIVITY_LEVELS[name], bins=(b, b, b), transform=True)
    for name, b in (("high", 0.3), ("medium", 0.6), ("low", 1.2))
}
BASELINES: dict[str, CodecSettings] = {
    f"uniform{bits}{suffix}": CodecSettings(quantizer="uniform", bits=bits, models=models)
    for bits in (8, 4, 3)
    for suffix, models in (("", "raw"), ("-ac", "layer-channel"))
}
ALL_LEVELS = {**LEVELS, **BASELINES}


def settings_for(level: str, profiled: bool = False, token_steps: bool = False, transform: bool = False
                 ) -> CodecSettings:
    """A level's settings; with `profiled` (the model has a profile), a CacheGen level's sensitivity form; with
    `token_steps` (the caller codes each token's importance), its steps-per-token form; with `transform` (the
    profile holds transforms and the caller knows the chunk's positions), its form over components. A level
    that has no such form (near-lossless) keeps the last one it has."""
    if level not in ALL_LEVELS:
        raise KvstrataError(f"level {level!r} is not one of {', '.join(ALL_LEVELS)}")
    if not profiled or level not in SENSITIVITY_LEVELS:
        return ALL_LEVELS[level]
    if token_steps and level in IMPORTANCE_LEVELS:
        return TRANSFORM_LEVELS[level] if transform else IMPORTANCE_LEVELS[level]
    if transform and level in COMPONENT_LEVELS:
        return COMPONENT_LEVELS[level]
    return SENSITIVITY_LEVELS[level]
