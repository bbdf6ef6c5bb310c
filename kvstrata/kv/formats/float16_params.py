"""Per-token quantization parameters stored as float16 bytes inside a token's record.

The encoder quantizes with the float16-rounded parameters, so the decoder, which only has the
bytes, multiplies by exactly the same numbers. Minimums round down and steps round up, so no value
falls outside the code range.

A parameter that float16 cannot hold (its values are NaN, infinite or beyond ±65504) is stored as NaN:
its tokens decode to NaN, attention over them gives NaN logits, and the engine ends that request alone
("not finite"), as it does for a float cache holding such values. Nothing is checked on the host, so
storing a layer never waits for the device.
"""

from __future__ import annotations

import torch

FLOAT16_MAX = 65504.0


def round_float16(values: torch.Tensor, toward: float) -> torch.Tensor:
    """The float16 nearest each value on the side of `toward` (-inf: at or below, +inf: at or above);
    values beyond float16's range become infinite."""
    rounded = values.to(torch.float16)
    wrong = rounded.to(values.dtype) > values if toward < 0 else rounded.to(values.dtype) < values
    return torch.where(wrong, torch.nextafter(rounded, torch.full_like(rounded, toward)), rounded)


def _nan_beyond_range(rounded: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.where(values.abs() <= FLOAT16_MAX, rounded, torch.nan)  # NaN compares false: NaN too


def float16_down(values: torch.Tensor) -> torch.Tensor:
    """The largest float16 at or below each value; NaN where float16 cannot hold it."""
    return _nan_beyond_range(round_float16(values, -torch.inf), values)


def float16_up(values: torch.Tensor) -> torch.Tensor:
    """The smallest float16 at or above each value; NaN where float16 cannot hold it."""
    return _nan_beyond_range(round_float16(values, torch.inf), values)


def params_to_bytes(params: torch.Tensor) -> torch.Tensor:
    """float16 [N, P] -> uint8 [N, 2P] (read back by `params_from_bytes`)."""
    return params.contiguous().view(torch.uint8)


def params_from_bytes(data: torch.Tensor) -> torch.Tensor:
    """uint8 [M, 2P] -> float32 [M, P]. A fresh copy: a slice of a record may start at an odd byte,
    which a float16 view cannot."""
    return data.clone(memory_format=torch.contiguous_format).view(torch.float16).float()
