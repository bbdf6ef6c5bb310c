"""KV given ready-made for a range of a prompt's tokens (a decoded saved context, a lower tier's blocks),
placed in the paged cache instead of being prefilled.

Storage writes it one layer at a time through `layer_kv`, so a source that fetches or decodes per layer
(`LayerwiseKV`) never needs every layer in memory at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstrata.errors import KvstrataError


@dataclass
class PreloadedKV:
    """Every layer at hand: K and V [layers, tokens, kv_heads, head_dim]."""

    start: int  # position of the first token
    k: torch.Tensor
    v: torch.Tensor
    # [layers, tokens], True where a layer did not load the token (IMPRESS): storage keeps its zeros, no step reads it
    unread: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.k.shape[1]

    def layer_kv(self, layer: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [end - first, kv_heads, head_dim] of positions first .. end in `layer`."""
        return self.k[layer, first - self.start : end - self.start], self.v[layer, first - self.start : end - self.start]

    def clipped(self, end: int) -> PreloadedKV | None:
        """The part before token `end`, if any."""
        return self.between(self.start, end)

    def between(self, first: int, end: int) -> PreloadedKV | None:
        """The part from token `first` to token `end` (views, not copies; itself if that is all of it), if any."""
        first, end = max(first, self.start), min(end, self.end)
        if end <= first:
            return None
        if (first, end) == (self.start, self.end):
            return self
        part = slice(first - self.start, end - self.start)
        unread = None if self.unread is None else self.unread[:, part]
        return PreloadedKV(first, self.k[:, part], self.v[:, part], unread)


@dataclass
class LayerwiseKV:
    """KV of tokens start .. end whose layers are loaded on demand: `load(layer)` returns K and V
    [num_loaded, kv_heads, head_dim] of that layer (fetched, decoded) when storage writes it; a clipped
    range uses only the first end - start of them."""

    start: int
    num_loaded: int
    load: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    shape: tuple[int, int]  # (kv_heads, head_dim) the loaded layers must have
    end: int = -1  # default: start + num_loaded

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.start + self.num_loaded

    def layer_kv(self, layer: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.load(layer)
        want = (self.num_loaded, *self.shape)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise KvstrataError(f"layer {layer} of preloaded KV has K {tuple(k.shape)} and V {tuple(v.shape)}, "
                                f"expected {want}")
        return k[first - self.start : end - self.start], v[first - self.start : end - self.start]

    def clipped(self, end: int) -> LayerwiseKV | None:
        if end <= self.start:
            return None
        return dataclasses.replace(self, end=min(end, self.end))


Preloaded = PreloadedKV | LayerwiseKV
