"""The two lossy stages, on one K or V tensor [layers, tokens, channels] of a chunk.

CacheGen (papers/cachegen.md §2.1-2.2): tokens form groups of GROUP_SIZE; a group's first token,
the anchor, is quantized at 8 bits with one scale per (layer, channel) (absmax over the chunk's
anchors). Every other token is coded as its difference from the *decoded* anchor of its group
(closed loop: an anchor's error never adds to its group's). Differences are quantized with a
uniform step per layer, step = bin x sigma, where sigma is the RMS of the layer's differences in
the chunk and bin comes from the quality level (coarser for deeper layer thirds). Error bounds:
anchor_scale / 2 for anchors, step / 2 for the rest.

Channel weighting: an error in key channel c moves attention scores by q_c times that error, so where
the queries are large an error costs more. Given each channel's importance (the mean square of the
queries that read it, profiled offline), a layer's step is spread over its channels as
step_c = step x g_c with g_c proportional to importance_c^(-1/2), normalized to a geometric mean of 1
(the bits stay about the same; the squared score error each channel adds is equalized, the rate-
distortion optimum for uniform quantizers). g travels in the stream as CHANNEL_CODE_STEPS-ths of an
octave (int8), so the decoder needs no profile.

Without differences (for V by default: on the default model V is nearly independent token to token,
so a difference has about twice a value's variance; docs/BENCHMARKS.md), tokens are quantized
directly with the same step, and only the chunk's first token is an 8-bit anchor: a context's first
token is the attention sink, whose error every later query reads.

Uniform baseline (FlexGen-style, §5): b-bit symmetric quantization per (layer, token), scale =
absmax over channels / (2^(b-1) - 1). Error bound: scale / 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 10
ANCHOR_LEVELS = 127  # 8-bit symmetric
CHANNEL_CODE_STEPS = 8  # a channel's step multiplier is 2 ** (code / CHANNEL_CODE_STEPS), code an int8
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
    channel_codes: torch.Tensor  # int8 [L, C]: each channel's step is step x channel_multipliers(codes)
    anchors: torch.Tensor  # int32 [L, A, C]
    rest: torch.Tensor  # int32 [L, T - A, C]: differences (or plain values without anchors)

    def channel_steps(self) -> torch.Tensor:
        """[L, C]"""
        return self.step[:, None] * channel_multipliers(self.channel_codes)


def channel_codes_for(importance: torch.Tensor | None, num_layers: int, channels: int) -> torch.Tensor:
    """int8 [L, C] step codes from each channel's importance [L, C] (None: one step for every channel)."""
    if importance is None:
        return torch.zeros(num_layers, channels, dtype=torch.int8)
    if tuple(importance.shape) != (num_layers, channels):
        raise ValueError(f"channel importance of shape {tuple(importance.shape)} does not fit {num_layers} layers "
                         f"x {channels} channels")
    log_g = -0.5 * importance.double().clamp_min(1e-30).log2()
    log_g -= log_g.mean(dim=1, keepdim=True)
    return torch.round(log_g * CHANNEL_CODE_STEPS).clamp(-127, 127).to(torch.int8)


def channel_multipliers(codes: torch.Tensor) -> torch.Tensor:
    return torch.exp2(codes.float() / CHANNEL_CODE_STEPS)


def layer_bins(bins: tuple[float, float, float], num_layers: int) -> torch.Tensor:
    """Each layer's bin: layers split into three equal thirds, shallow to deep."""
    return torch.tensor([bins[min(3 * layer // num_layers, 2)] for layer in range(num_layers)], dtype=torch.float32)


def anchor_positions(num_tokens: int, differences: bool = True) -> torch.Tensor:
    return torch.arange(0, num_tokens, GROUP_SIZE if differences else max(num_tokens, 1))


def _anchor_reference(anchors_hat: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's decoded anchor [L, T, C]."""
    return anchors_hat.repeat_interleave(GROUP_SIZE, dim=1)[:, :num_tokens]


def _non_anchor_mask(num_tokens: int, differences: bool = True) -> torch.Tensor:
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[anchor_positions(num_tokens, differences)] = False
    return mask


def _quantize_anchors(anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit symbols [L, A, C] with one scale per (layer, channel)."""
    scale = _stored_scale(anchors.abs().amax(dim=1) / ANCHOR_LEVELS)
    return scale, torch.round(anchors / scale.float()[:, None]).clamp(-ANCHOR_LEVELS, ANCHOR_LEVELS)


def differences_from_anchors(x: torch.Tensor, anchors_hat: torch.Tensor) -> torch.Tensor:
    """Every non-anchor token minus its group's decoded anchor [L, T - A, C]."""
    num_tokens = x.shape[1]
    return (x - _anchor_reference(anchors_hat, num_tokens))[:, _non_anchor_mask(num_tokens)]


def quantize_cachegen(x: torch.Tensor, bins: torch.Tensor, differences: bool = True,
                      channel_codes: torch.Tensor | None = None) -> CacheGenSymbols:
    """`bins` [L]: each layer's step in units of its anchor-difference RMS (the unit either way);
    `channel_codes` [L, C] (channel_codes_for) spread it over the channels."""
    num_layers, num_tokens, channels = x.shape
    codes = channel_codes if channel_codes is not None else channel_codes_for(None, num_layers, channels)
    anchor_scale, anchor_symbols = _quantize_anchors(x[:, anchor_positions(num_tokens)])
    diffs = differences_from_anchors(x, anchor_symbols * anchor_scale.float()[:, None])
    sigma = diffs.square().mean(dim=(1, 2)).sqrt() if diffs.numel() else torch.ones(num_layers)
    step = torch.where(sigma > 0, bins * sigma, torch.ones_like(sigma)).float()
    steps = (step[:, None] * channel_multipliers(codes))[:, None]
    if differences:
        return CacheGenSymbols(anchor_scale, step, codes, anchor_symbols.int(), torch.round(diffs / steps).int())
    first_scale, first_symbols = _quantize_anchors(x[:, :1])
    rest = torch.round(x[:, _non_anchor_mask(num_tokens, False)] / steps)
    return CacheGenSymbols(first_scale, step, codes, first_symbols.int(), rest.int())


def dequantize_cachegen(symbols: CacheGenSymbols, num_tokens: int, differences: bool = True) -> torch.Tensor:
    step = symbols.channel_steps()[:, None]
    anchors_hat = symbols.anchors.float() * symbols.anchor_scale.float()[:, None]
    rest = symbols.rest.float() * step
    if differences:
        x = _anchor_reference(anchors_hat, num_tokens).clone()
        x[:, _non_anchor_mask(num_tokens)] += rest
        return x
    return torch.cat((anchors_hat, rest), dim=1)


def cachegen_error_bound(symbols: CacheGenSymbols, num_tokens: int, differences: bool = True) -> torch.Tensor:
    """The largest error each element may have [L, T, C] (exact arithmetic; float32 adds ~1e-7 relative)."""
    num_layers, _, channels = symbols.rest.shape
    bound = (symbols.channel_steps() / 2)[:, None].expand(num_layers, num_tokens, channels).clone()
    bound[:, anchor_positions(num_tokens, differences)] = (symbols.anchor_scale.float() / 2)[:, None]
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
