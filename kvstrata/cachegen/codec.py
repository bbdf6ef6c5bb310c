"""One K or V tensor of a chunk [layers, tokens, channels] to named byte sections and back.

Sections: "scales" (the quantizer's scales), "channels" (CacheGen's per-channel step codes, present
when the steps come from sensitivity), "models" (count tables, symbol ranges for profiled models, or fitted
models' parameters: fitted_models.py; absent for raw storage) and the symbols: "rans" or "symbols" as coded
by one of the two range coders (entropy.py), or "symbols" bit-packed for raw storage.
Coder groups (papers/cachegen.md §2.3): with per-(layer, channel) models, each layer's anchors
share one model and each (layer, channel) has its own for the differences; with a global model,
anchors and differences have one model each. Steps per token (`token_steps`) add one group per layer, its
tokens' codes, after the others. With `transform`, what is quantized and coded is each KV head's
decorrelated components (transform.py), and the decoder turns them back with the same profile.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvstrata.cachegen import entropy
from kvstrata.cachegen.errors import CorruptStreamError
from kvstrata.cachegen.fitted_models import FittedModels
from kvstrata.cachegen.levels import CodecSettings
from kvstrata.cachegen.quantize import (
    TOKEN_CODE_LIMIT,
    CacheGenSymbols,
    UniformSymbols,
    anchor_positions,
    dequantize_cachegen,
    dequantize_uniform,
    layer_bins,
    quantize_cachegen,
    quantize_uniform,
    uniform_levels,
)
from kvstrata.errors import KvstrataError

if TYPE_CHECKING:  # the profile module runs the model (calibration); the codec only calls a profile's methods
    from kvstrata.cachegen.profile import TensorProfile
    from kvstrata.cachegen.transform import ChannelTransform

MAX_TABLE = 1 << 20  # the widest symbol range a count table may describe


def encode_tensor(
    x: torch.Tensor, settings: CodecSettings, kind: str, profile: TensorProfile | None = None,
    steps: tuple[torch.Tensor, torch.Tensor] | None = None, token_codes: torch.Tensor | None = None,
    first_position: int = 0, transform: ChannelTransform | None = None,
) -> dict[str, bytes]:
    """`kind`: "k" or "v" (the settings may code them differently). `profile`: the model's profile of this
    tensor, needed by profiled coder models, by allocation "sensitivity", whose steps it gives unless
    `steps` (layer steps [L] and channel codes [L, C], for a slice of the layers) are given, and by
    `transform`. `token_codes` [L, T]: each token's step code, for settings with `token_steps`
    (token_importance.py makes them). `first_position`: the chunk's first token's position in its context
    (a transform codes keys before RoPE; settings with `sink_anchor_only` anchor only at 0). `transform`: for
    a slice of the layers, with that slice's `steps` (default: the profile's, with its component steps)."""
    x = x.float().cpu()
    if not torch.isfinite(x).all():
        raise ValueError("the KV tensor holds NaN or inf values; such a cache cannot be encoded")
    _check_position(first_position)
    anchored = anchors_first_token(settings, first_position)
    if settings.transform:
        if (transform is None) != (steps is None):
            raise ValueError("a transform for a slice of the layers comes with that slice's steps, and only with them")
        x = to_components(x, transform or _transform_of(profile), first_position, anchored)
        steps = steps or profile.component_steps(settings.bins[0])
    if settings.quantizer == "uniform":
        symbols = quantize_uniform(x, settings.bits)
        sections = {"scales": symbols.scale.numpy().tobytes()}
        if settings.models == "raw":
            sections["symbols"] = pack_bits(symbols.values + uniform_levels(settings.bits), settings.bits)
            return sections
        groups = _uniform_groups(symbols.values, settings.models)
    else:
        differences = settings.differences_for(kind)
        if settings.allocation == "sensitivity":
            if steps is None and profile is None:
                raise ValueError("allocation 'sensitivity' needs the model's profile (kvstrata calibrate cachegen)")
            if steps is None:
                steps = profile.steps(settings.bins[0])
        if settings.token_steps != (token_codes is not None):
            raise ValueError(f"settings with token_steps={settings.token_steps} take token codes only with it")
        symbols = quantize_cachegen(x, layer_bins(settings.bins, x.shape[0]), differences, steps, token_codes,
                                    anchored)
        anchor_scales = symbols.anchor_scale.numpy().tobytes() if symbols.anchored else b""
        sections = {"scales": anchor_scales + symbols.step.numpy().tobytes()}
        if steps is not None and not settings.transform:  # a transform's components share one step: codes all 0
            sections["channels"] = symbols.channel_codes.numpy().tobytes()
        groups = _cachegen_groups(symbols, settings.models)
        if token_codes is not None:
            groups.extend(token_codes.numpy().astype(np.int32))
    group_models = group_offsets = None  # each group its own model, coded as it is
    if settings.source == "profiled":
        models = profile.models_for(groups, _unit_bins(settings, symbols.step, profile), differences,
                                    symbols.channel_codes)
        sections["models"] = entropy.write_ranges(groups)
    elif settings.source == "fitted":
        fitted = FittedModels.fit(groups)
        sections["models"] = fitted.to_bytes()
        models, group_models = fitted.coder_models
        group_offsets = fitted.offsets()
    else:
        counted = [entropy.counted_model(g) for g in groups]
        models = [m for m, _ in counted]
        sections["models"] = entropy.write_count_tables([c for _, c in counted], [m.lo for m in models])
    coder_section, symbols = entropy.encode_groups(groups, models, group_models, group_offsets)
    sections[coder_section] = symbols
    return sections


def decode_tensor(
    sections: dict[str, bytes], settings: CodecSettings, shape: tuple[int, int, int], kind: str,
    profile: TensorProfile | None = None, first_position: int = 0, transform: ChannelTransform | None = None,
) -> torch.Tensor:
    """`transform`: for a tensor of a slice of the layers (default: the profile's)."""
    _check_position(first_position)
    anchored = anchors_first_token(settings, first_position)
    if settings.transform:
        coded = decode_tensor(sections, dataclasses.replace(settings, transform=False), shape, kind, profile,
                              first_position)
        return from_components(coded, transform or _transform_of(profile), first_position, anchored)
    num_layers, num_tokens, channels = shape
    scales = sections["scales"]
    if settings.quantizer == "uniform":
        scale = torch.from_numpy(_array(scales, np.float16, (num_layers, num_tokens), "scales"))
        qmax = uniform_levels(settings.bits)
        if settings.models == "raw":
            values = unpack_bits(sections["symbols"], settings.bits, num_layers * num_tokens * channels) - qmax
            values = values.reshape(num_layers, num_tokens, channels)
        else:
            flat = _decode_symbols(sections, settings, _uniform_sizes(shape, settings.models), None, False, None)
            values = flat.reshape(num_layers, channels, num_tokens).transpose(0, 2, 1)
        if np.abs(values).max(initial=0) > qmax:
            raise CorruptStreamError(f"a decoded symbol lies outside [-{qmax}, {qmax}]")
        return dequantize_uniform(UniformSymbols(scale, torch.from_numpy(values.astype(np.int32))))
    differences = settings.differences_for(kind)
    num_anchors = len(anchor_positions(num_tokens, differences)) if differences or anchored else 0
    anchor_bytes = 2 * num_layers * channels if num_anchors else 0
    anchor_scale = (torch.from_numpy(_array(scales[:anchor_bytes], np.float16, (num_layers, channels), "anchor scales"))
                    if num_anchors else torch.ones(num_layers, channels, dtype=torch.float16))
    step = torch.from_numpy(_array(scales[anchor_bytes:], np.float32, (num_layers,), "steps"))
    codes = (torch.from_numpy(_array(sections["channels"], np.int8, (num_layers, channels), "channels"))
             if "channels" in sections else torch.zeros(num_layers, channels, dtype=torch.int8))
    if settings.source == "profiled" and num_layers != len(profile.sigma):
        raise CorruptStreamError(f"a stream of {num_layers} layers does not fit a profile of {len(profile.sigma)}")
    sizes = _cachegen_sizes(num_layers, num_anchors, num_tokens - num_anchors, channels, settings.models)
    token_sizes = [num_tokens] * num_layers if settings.token_steps else []
    flat = _decode_symbols(sections, settings, sizes + token_sizes, profile, differences, codes, step)
    symbols = _cachegen_from_symbols(flat[: sum(sizes)], anchor_scale, step, codes, num_layers, num_anchors,
                                     num_tokens, channels, settings.models)
    if settings.token_steps:
        token_codes = flat[sum(sizes) :].reshape(num_layers, num_tokens)
        if np.abs(token_codes).max(initial=0) > TOKEN_CODE_LIMIT:
            raise CorruptStreamError(f"a decoded token code lies outside [-{TOKEN_CODE_LIMIT}, {TOKEN_CODE_LIMIT}]")
        symbols.token_codes = torch.from_numpy(token_codes.astype(np.int8))
    return dequantize_cachegen(symbols, num_tokens, differences)


def anchors_first_token(settings: CodecSettings, first_position: int) -> bool:
    """Whether a tensor coded without differences keeps its chunk's first token as an 8-bit anchor: always, unless
    the settings anchor only the attention sink (`sink_anchor_only`) and the chunk starts after it."""
    return not settings.sink_anchor_only or first_position == 0


def to_components(x: torch.Tensor, transform: ChannelTransform, first_position: int,
                  anchored: bool = True) -> torch.Tensor:
    """x [L, T, C] of a chunk whose first token sits at `first_position`, over each KV head's components; where
    `anchored`, the chunk's first token, its 8-bit anchor, stays as it is (transformed with the rest and put back:
    one copy of the tensor fewer than transforming the rest alone)."""
    z = transform.forward(x, first_position)
    if anchored:
        z[:, 0] = x[:, 0]
    return z


def from_components(coded: torch.Tensor, transform: ChannelTransform, first_position: int,
                    anchored: bool = True) -> torch.Tensor:
    """to_components undone (a tensor of several layers at once costs one product per head for them all)."""
    x = transform.inverse(coded, first_position)
    if anchored:
        x[:, 0] = coded[:, 0]
    return x


def _check_position(first_position) -> None:
    if isinstance(first_position, bool) or not isinstance(first_position, int) or first_position < 0:
        raise ValueError(f"first_position must be a non-negative integer (the chunk's first token's position), got "
                         f"{first_position!r}")


def _transform_of(profile: TensorProfile | None) -> ChannelTransform:
    if profile is None or profile.transform is None:
        raise KvstrataError("settings with transform need the model's profile of version 5 (kvstrata calibrate "
                            "cachegen), which holds the transforms")
    return profile.transform


def _unit_bins(settings: CodecSettings, steps: torch.Tensor, profile: TensorProfile) -> torch.Tensor:
    """Each layer's step in units of its RMS, as the profiled coder models need it: the level's bins, or the
    sensitivity steps over the profiled RMS (the decoder knows the steps, not the chunk's RMS)."""
    if settings.allocation == "sensitivity":
        return profile.unit_bins(steps)
    return layer_bins(settings.bins, len(steps))


def _decode_symbols(sections, settings: CodecSettings, sizes: list[int], profile, differences: bool,
                    channel_codes, steps=None) -> np.ndarray:
    """Every coder group's symbols, concatenated in group order."""
    if settings.source == "fitted":
        fitted = FittedModels.from_bytes(sections["models"], len(sizes))
        models, group_models = fitted.coder_models
        return entropy.decode_symbols(sections, models, sizes, group_models, fitted.offsets())
    if settings.source == "profiled":
        ranges = entropy.read_ranges(sections["models"], len(sizes))
        models = profile.models_for_ranges(ranges, _unit_bins(settings, steps, profile), differences, channel_codes)
    else:
        models = entropy.read_count_tables(sections["models"], len(sizes), MAX_TABLE)
    return entropy.decode_symbols(sections, models, sizes)


def _array(data: bytes, dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if len(data) != expected:
        raise CorruptStreamError(f"the {what} section holds {len(data)} bytes, expected {expected}")
    array = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    if not np.isfinite(array).all():
        raise CorruptStreamError(f"the {what} section holds a non-finite number")
    return array


# --- coder groups -----------------------------------------------------------------------------


def _cachegen_groups(symbols: CacheGenSymbols, models: str) -> list[np.ndarray]:
    anchors = symbols.anchors.numpy()
    rest = symbols.rest.permute(0, 2, 1).contiguous().numpy()  # [L, C, tokens]: a channel's symbols in a row
    if models == "global":
        return [anchors.reshape(-1), rest.reshape(-1)]
    groups = []
    for layer in range(anchors.shape[0]):
        groups.append(anchors[layer].reshape(-1))
        groups.extend(rest[layer])
    return groups


def _cachegen_sizes(num_layers: int, num_anchors: int, num_rest: int, channels: int, models: str) -> list[int]:
    if models == "global":
        return [num_layers * num_anchors * channels, num_layers * num_rest * channels]
    return ([num_anchors * channels] + [num_rest] * channels) * num_layers


def _cachegen_from_symbols(flat, anchor_scale, step, channel_codes, num_layers, num_anchors, num_tokens, channels,
                           models):
    """The symbols of _cachegen_groups' groups (concatenated) back in place: with a global model, all anchors then
    all differences; per (layer, channel), each layer's anchors then its channels' differences."""
    num_rest = num_tokens - num_anchors
    anchor_count = num_anchors * channels
    if models == "global":
        anchors = flat[: num_layers * anchor_count].reshape(num_layers, num_anchors, channels)
        rest = flat[num_layers * anchor_count :].reshape(num_layers, channels, num_rest)
    else:
        per_layer = flat.reshape(num_layers, anchor_count + channels * num_rest)
        anchors = per_layer[:, :anchor_count].reshape(num_layers, num_anchors, channels)
        rest = per_layer[:, anchor_count:].reshape(num_layers, channels, num_rest)
    if np.abs(anchors).max(initial=0) > 127:
        raise CorruptStreamError("a decoded anchor symbol lies outside [-127, 127]")
    return CacheGenSymbols(
        anchor_scale, step, channel_codes, torch.from_numpy(anchors.astype(np.int32)),
        torch.from_numpy(rest.astype(np.int32)).permute(0, 2, 1),
    )


def _uniform_groups(values: torch.Tensor, models: str) -> list[np.ndarray]:
    per_channel = values.permute(0, 2, 1).contiguous().numpy()
    return [per_channel.reshape(-1)] if models == "global" else list(per_channel.reshape(-1, values.shape[1]))


def _uniform_sizes(shape: tuple[int, int, int], models: str) -> list[int]:
    num_layers, num_tokens, channels = shape
    return [num_layers * num_tokens * channels] if models == "global" else [num_tokens] * (num_layers * channels)


# --- raw storage ------------------------------------------------------------------------------


def pack_bits(values: torch.Tensor, bits: int) -> bytes:
    """Non-negative integers below 2**bits, `bits` bits each, little-endian bit order."""
    flat = values.reshape(-1).numpy().astype(np.uint8)
    if bits == 8:
        return flat.tobytes()
    planes = (flat[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: bytes, bits: int, count: int) -> np.ndarray:
    expected = -(-count * bits // 8)
    if len(data) != expected:
        raise CorruptStreamError(f"the packed symbols hold {len(data)} bytes, expected {expected}")
    raw = np.frombuffer(data, dtype=np.uint8)
    if bits == 8:
        return raw.astype(np.int64)
    planes = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits)
    return (planes.astype(np.int64) << np.arange(bits)).sum(axis=1)
