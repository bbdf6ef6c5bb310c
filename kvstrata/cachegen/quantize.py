"""The two lossy stages, on one K or V tensor [layers, tokens, channels] of a chunk.

CacheGen (papers/cachegen.md §2.1-2.2): tokens form groups of GROUP_SIZE; a group's first token,
the anchor, is quantized at 8 bits with one scale per (layer, channel) (absmax over the chunk's
anchors). Every other token is coded as its difference from the *decoded* anchor of its group
(closed loop: an anchor's error never adds to its group's). Differences are quantized with a
uniform step per layer, step = bin x sigma, where sigma is the RMS of the layer's differences in
the chunk and bin comes from the quality level (coarser for deeper layer thirds). Error bounds:
anchor_scale / 2 for anchors, step / 2 for the rest.

Steps from sensitivity: an error e in channel (l, c) costs about F[l, c] e^2 (F: the mean squared gradient
of the later tokens' loss, profiled offline: sensitivity.py), and a uniform quantizer of step s adds s^2 / 12
of squared error at about -log2(s) bits. Equal marginal returns give s[l, c] = scale / sqrt(F[l, c]) for
every layer and channel at once: the rate-distortion optimum for uniform quantizers. The steps are absolute,
so a level holds its error on any text and its size follows the text. A layer's step is the geometric mean
of its channels' steps, and each channel's ratio to it travels in the stream as CHANNEL_CODE_STEPS-ths of
an octave (int8), so the decoder needs no profile.

Without differences (for V by default: on the default model V is nearly independent token to token,
so a difference has about twice a value's variance; docs/BENCHMARKS.md), tokens are quantized
directly with the same step, and only the chunk's first token is an 8-bit anchor: a context's first
token is the attention sink, whose error every later query reads. A caller that knows the chunk starts
after its context's first token may leave the anchor out (`anchored=False`): its first token is then coded
like the rest, and no anchor scales travel.

Steps per token: a stream may also carry one code per (layer, token) that scales the token's steps by
2 ** (-code / TOKEN_CODE_STEPS), finer for the tokens later queries read most (token_importance.py); only for
tensors coded without differences.

Uniform baseline (FlexGen-style, §5): b-bit symmetric quantization per (layer, token), scale =
absmax over channels / (2^(b-1) - 1). Error bound: scale / 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GROUP_SIZE = 10
ANCHOR_LEVELS = 127  # 8-bit symmetric
CHANNEL_CODE_STEPS = 8  # a channel's step multiplier is 2 ** (code / CHANNEL_CODE_STEPS), code an int8
TOKEN_CODE_STEPS = 4  # a token's step multiplier is 2 ** (-code / TOKEN_CODE_STEPS)
TOKEN_CODE_LIMIT = 16  # token codes lie in [-16, 16]: steps at most 16x finer or coarser
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
    token_codes: torch.Tensor | None = None  # int8 [L, T]: steps per token (TOKEN_CODE_STEPS), or one step for all

    def channel_steps(self) -> torch.Tensor:
        """[L, C]"""
        return self.step[:, None] * channel_multipliers(self.channel_codes)

    def steps(self) -> torch.Tensor:
        """Every element's step [L, T, C] (the anchors' entries unused); [L, 1, C] without token codes."""
        steps = self.channel_steps()[:, None]
        return steps if self.token_codes is None else steps * token_multipliers(self.token_codes)[..., None]

    @property
    def anchored(self) -> bool:
        return self.anchors.shape[1] > 0

    def rest_steps(self, num_tokens: int, differences: bool) -> torch.Tensor:
        """The steps of the non-anchor tokens [L, T - A, C] (or [L, 1, C])."""
        steps = self.steps()
        if self.token_codes is None:
            return steps
        return steps[:, _non_anchor_mask(num_tokens, differences)] if self.anchored else steps


def steps_from_sensitivity(sensitivity: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each layer's step [L] and its channels' step codes [L, C] for steps scale / sqrt(sensitivity [L, C])."""
    log_steps = math.log2(scale) - 0.5 * sensitivity.double().clamp_min(1e-30).log2()
    layer = log_steps.mean(dim=1)
    codes = torch.round((log_steps - layer[:, None]) * CHANNEL_CODE_STEPS).clamp(-127, 127).to(torch.int8)
    return torch.exp2(layer).float(), codes


def channel_multipliers(codes: torch.Tensor) -> torch.Tensor:
    return torch.exp2(codes.float() / CHANNEL_CODE_STEPS)


def token_multipliers(codes: torch.Tensor) -> torch.Tensor:
    return torch.exp2(-codes.float() / TOKEN_CODE_STEPS)


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
    """8-bit symbols [L, A, C] with one scale per (layer, channel) (scales of 1 where there are no anchors)."""
    if anchors.shape[1] == 0:
        return torch.ones(anchors.shape[0], anchors.shape[2], dtype=torch.float16), anchors.clone()
    scale = _stored_scale(anchors.abs().amax(dim=1) / ANCHOR_LEVELS)
    return scale, torch.round(anchors / scale.float()[:, None]).clamp(-ANCHOR_LEVELS, ANCHOR_LEVELS)


def differences_from_anchors(x: torch.Tensor, anchors_hat: torch.Tensor) -> torch.Tensor:
    """Every non-anchor token minus its group's decoded anchor [L, T - A, C]."""
    num_tokens = x.shape[1]
    return (x - _anchor_reference(anchors_hat, num_tokens))[:, _non_anchor_mask(num_tokens)]


def quantize_cachegen(x: torch.Tensor, bins: torch.Tensor | None, differences: bool = True,
                      steps: tuple[torch.Tensor, torch.Tensor] | None = None,
                      token_codes: torch.Tensor | None = None, anchored: bool = True) -> CacheGenSymbols:
    """`bins` [L]: each layer's step in units of its anchor-difference RMS, one step for all its channels;
    or `steps`: absolute layer steps [L] and channel codes [L, C] (steps_from_sensitivity), with `token_codes`
    [L, T] (int8 in [-TOKEN_CODE_LIMIT, TOKEN_CODE_LIMIT]) scaling each token's steps. `anchored`: without
    differences, whether the first token is an 8-bit anchor (with differences, every group has one)."""
    num_layers, num_tokens, channels = x.shape
    if token_codes is not None and (differences or token_codes.shape != (num_layers, num_tokens)
                                    or token_codes.int().abs().max() > TOKEN_CODE_LIMIT):
        raise ValueError(f"token codes [{num_layers}, {num_tokens}] in [-{TOKEN_CODE_LIMIT}, {TOKEN_CODE_LIMIT}] need "
                         f"a tensor coded without differences; got {tuple(token_codes.shape)}, differences "
                         f"{differences}")
    anchor_scale, anchor_symbols = _quantize_anchors(x[:, anchor_positions(num_tokens)])
    diffs = differences_from_anchors(x, anchor_symbols * anchor_scale.float()[:, None])
    if steps is None:
        sigma = layer_rms(diffs)
        step = torch.where(sigma > 0, bins * sigma, torch.ones_like(sigma)).float()
        codes = torch.zeros(num_layers, channels, dtype=torch.int8)
    else:
        step, codes = steps
    if differences:
        symbols = CacheGenSymbols(anchor_scale, step, codes, anchor_symbols.int(), diffs)
    else:
        first = 1 if anchored else 0
        first_scale, first_symbols = _quantize_anchors(x[:, :first])
        rest = x[:, first:]
        symbols = CacheGenSymbols(first_scale, step, codes, first_symbols.int(), rest, token_codes)
    symbols.rest = torch.round(symbols.rest / symbols.rest_steps(num_tokens, differences)).int()
    return symbols


def layer_rms(diffs: torch.Tensor) -> torch.Tensor:
    """Each layer's RMS [L] of anchor differences [L, T', C] (the unit of `bins`; 1 where there are none)."""
    return diffs.square().mean(dim=(1, 2)).sqrt() if diffs.numel() else torch.ones(diffs.shape[0])


def dequantize_cachegen(symbols: CacheGenSymbols, num_tokens: int, differences: bool = True) -> torch.Tensor:
    anchors_hat = symbols.anchors.float() * symbols.anchor_scale.float()[:, None]
    rest = symbols.rest.float() * symbols.rest_steps(num_tokens, differences)
    if differences:
        x = _anchor_reference(anchors_hat, num_tokens).clone()
        x[:, _non_anchor_mask(num_tokens)] += rest
        return x
    return torch.cat((anchors_hat, rest), dim=1)


def cachegen_error_bound(symbols: CacheGenSymbols, num_tokens: int, differences: bool = True) -> torch.Tensor:
    """The largest error each element may have [L, T, C] (exact arithmetic; float32 adds ~1e-7 relative)."""
    num_layers, _, channels = symbols.rest.shape
    bound = (symbols.steps() / 2).expand(num_layers, num_tokens, channels).clone()
    if symbols.anchored:
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
