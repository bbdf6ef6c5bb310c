"""The two lossy stages, on one K or V tensor [layers, tokens, channels] of a chunk.

CacheGen (papers/cachegen.md §2.1-2.2): tokens form groups of GROUP_SIZE; a group's first token,
the anchor, is quantized at 8 bits with one scale per (layer, channel) (absmax over the chunk's
anchors). Every other token is coded as its difference from the *decoded* anchor of its group
(closed loop: an anchor's error never adds to its group's). Differences are quantized with a
uniform step per layer, step = bin x sigma, where sigma is the RMS of the layer's differences in
the chunk and bin comes from the quality level (coarser for deeper layer thirds). Error bounds:
anchor_scale / 2 for anchors, step / 2 for the rest.

Uniform baseline (FlexGen-style, §5): b-bit symmetric quantization per (layer, token), scale =
absmax over channels / (2^(b-1) - 1). Error bound: scale / 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 10
ANCHOR_LEVELS = 127  # 8-bit symmetric
FLOAT16_TINY = 2.0**-14


def _stored_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scales travel as float16; quantize with the rounded value so the decoder multiplies by the same
    number. Rounding is nudged upward (float16 keeps 11 significant bits) so that absmax / scale never
    exceeds the top symbol and nothing is clipped; scales below float16's smallest normal number are
    raised to it (subnormals keep fewer bits). A zero scale (an all-zero vector) becomes 1."""
    scale = torch.where(scale > 0, (scale * (1 + 2**-10)).clamp_min(FLOAT16_TINY), torch.ones_like(scale))
    scale = scale.to(torch.float16)
    if not torch.isfinite(scale).all() or (scale == 0).any():
        raise ValueError("a quantization scale is outside float16's range; the KV values are too large or too small")
    return scale


@dataclass
class CacheGenSymbols:
    anchor_scale: torch.Tensor  # float16 [L, C]
    step: torch.Tensor  # float32 [L]
    anchors: torch.Tensor  # int32 [L, A, C]
    rest: torch.Tensor  # int32 [L, T - A, C]: differences (or plain values without anchors)


def layer_bins(bins: tuple[float, float, float], num_layers: int) -> torch.Tensor:
    """Each layer's bin: layers split into three equal thirds, shallow to deep."""
    return torch.tensor([bins[min(3 * layer // num_layers, 2)] for layer in range(num_layers)], dtype=torch.float32)


def anchor_positions(num_tokens: int) -> torch.Tensor:
    return torch.arange(0, num_tokens, GROUP_SIZE)


def _anchor_reference(anchors_hat: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's decoded anchor [L, T, C]."""
    return anchors_hat.repeat_interleave(GROUP_SIZE, dim=1)[:, :num_tokens]


def _non_anchor_mask(num_tokens: int) -> torch.Tensor:
    return torch.arange(num_tokens) % GROUP_SIZE != 0


def differences_from_anchors(x: torch.Tensor, anchors_hat: torch.Tensor) -> torch.Tensor:
    """Every non-anchor token minus its group's decoded anchor [L, T - A, C]."""
    num_tokens = x.shape[1]
    return (x - _anchor_reference(anchors_hat, num_tokens))[:, _non_anchor_mask(num_tokens)]


def quantize_cachegen(x: torch.Tensor, bins: torch.Tensor, use_anchors: bool = True) -> CacheGenSymbols:
    """`bins` [L]: each layer's step in units of its difference RMS. Without anchors (an ablation)
    every token is quantized on its own with the same step, and `anchors` is empty."""
    num_layers, num_tokens, channels = x.shape
    anchors = x[:, anchor_positions(num_tokens)]
    anchor_scale = _stored_scale(anchors.abs().amax(dim=1) / ANCHOR_LEVELS)
    anchor_symbols = torch.round(anchors / anchor_scale.float()[:, None]).clamp(-ANCHOR_LEVELS, ANCHOR_LEVELS)
    differences = differences_from_anchors(x, anchor_symbols * anchor_scale.float()[:, None])
    sigma = differences.square().mean(dim=(1, 2)).sqrt() if differences.numel() else torch.ones(num_layers)
    step = torch.where(sigma > 0, bins * sigma, torch.ones_like(sigma)).float()
    if use_anchors:
        rest = torch.round(differences / step[:, None, None])
        return CacheGenSymbols(anchor_scale, step, anchor_symbols.int(), rest.int())
    rest = torch.round(x / step[:, None, None])
    return CacheGenSymbols(anchor_scale, step, torch.zeros(num_layers, 0, channels, dtype=torch.int32), rest.int())


def dequantize_cachegen(symbols: CacheGenSymbols, num_tokens: int) -> torch.Tensor:
    step = symbols.step[:, None, None]
    if symbols.anchors.shape[1] == 0:
        return symbols.rest.float() * step
    anchors_hat = symbols.anchors.float() * symbols.anchor_scale.float()[:, None]
    x = _anchor_reference(anchors_hat, num_tokens).clone()
    x[:, _non_anchor_mask(num_tokens)] += symbols.rest.float() * step
    return x


def cachegen_error_bound(symbols: CacheGenSymbols, num_tokens: int) -> torch.Tensor:
    """The largest error each element may have [L, T, C] (exact arithmetic; float32 adds ~1e-7 relative)."""
    num_layers, _, channels = symbols.rest.shape
    bound = (symbols.step / 2)[:, None, None].expand(num_layers, num_tokens, channels).clone()
    if symbols.anchors.shape[1]:
        bound[:, anchor_positions(num_tokens)] = (symbols.anchor_scale.float() / 2)[:, None]
    return bound


@dataclass
class UniformSymbols:
    scale: torch.Tensor  # float16 [L, T]
    values: torch.Tensor  # int32 [L, T, C] in [-qmax, qmax]


def uniform_levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize_uniform(x: torch.Tensor, bits: int) -> UniformSymbols:
    qmax = uniform_levels(bits)
    scale = _stored_scale(x.abs().amax(dim=2) / qmax)
    values = torch.round(x / scale.float()[..., None]).clamp(-qmax, qmax)
    return UniformSymbols(scale, values.int())


def dequantize_uniform(symbols: UniformSymbols) -> torch.Tensor:
    return symbols.values.float() * symbols.scale.float()[..., None]
