"""Per-token quantization parameters stored as float16 bytes inside a token's record.

The encoder quantizes with the float16-rounded parameters, so the decoder, which only has the
bytes, multiplies by exactly the same numbers. Minimums round down and steps round up, so no value
falls outside the code range.
"""

from __future__ import annotations

import torch

from kvstrata.errors import KvstrataError


def round_float16(values: torch.Tensor, toward: float) -> torch.Tensor:
    """The float16 nearest each value on the side of `toward` (-inf: at or below, +inf: at or above);
    values beyond float16's range become infinite."""
    rounded = values.to(torch.float16)
    wrong = rounded.to(values.dtype) > values if toward < 0 else rounded.to(values.dtype) < values
    return torch.where(wrong, torch.nextafter(rounded, torch.full_like(rounded, toward)), rounded)


def _finite(rounded: torch.Tensor, values: torch.Tensor, what: str) -> torch.Tensor:
    if not torch.isfinite(rounded).all():
        raise KvstrataError(f"a {what} of {values.abs().max().item():.4g} is outside float16's range (65504)")
    return rounded


def float16_down(values: torch.Tensor, what: str) -> torch.Tensor:
    """The largest float16 at or below each value."""
    return _finite(round_float16(values, -torch.inf), values, what)


def float16_up(values: torch.Tensor, what: str) -> torch.Tensor:
    """The smallest float16 at or above each value."""
    return _finite(round_float16(values, torch.inf), values, what)


def params_to_bytes(params: torch.Tensor) -> torch.Tensor:
    """float16 [N, P] -> uint8 [N, 2P] (read back by `params_from_bytes`)."""
    return params.contiguous().view(torch.uint8)


def params_from_bytes(data: torch.Tensor) -> torch.Tensor:
    """uint8 [M, 2P] -> float32 [M, P]. A fresh copy: a slice of a record may start at an odd byte,
    which a float16 view cannot."""
    return data.clone(memory_format=torch.contiguous_format).view(torch.float16).float()


def require_finite(x: torch.Tensor) -> None:
    bad = ~torch.isfinite(x)
    if bad.any():
        tokens = bad.any(dim=-1).nonzero().flatten().tolist()
        raise KvstrataError(f"KV values of tokens {tokens[:8]} are NaN or infinite; a quantized cache cannot store them")
