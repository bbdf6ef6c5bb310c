"""Asymmetric uniform quantization over one dimension: b-bit codes from a float16 minimum and step
(min rounded down, step up, so no code is clipped); error bound step / 2."""

from __future__ import annotations

import torch

from kvstrata.kv.formats.float16_params import float16_down, float16_up


def quantize_asymmetric(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, shaped like x) and float16 params [..., 2] = (min, step) with `dim` reduced; a slice
    holding a value float16 cannot (NaN, infinite, beyond ±65504) gets NaN params and so decodes to NaN."""
    low = float16_down(x.amin(dim=dim))
    step = float16_up((x.amax(dim=dim) - low.float()) / (2**bits - 1))
    safe = torch.where(step > 0, step.float(), torch.ones_like(step, dtype=torch.float32))
    codes = torch.round((x - low.float().unsqueeze(dim)) / safe.unsqueeze(dim)).clamp(0, 2**bits - 1)
    return codes.to(torch.uint8), torch.stack((low, step), dim=-1)


def dequantize_asymmetric(codes: torch.Tensor, params: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 values from codes and float32 (min, step) params [..., 2] with `dim` reduced."""
    return params[..., 0].unsqueeze(dim) + codes.float() * params[..., 1].unsqueeze(dim)
