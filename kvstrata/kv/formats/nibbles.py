"""4-bit codes, two per byte: value i in byte i // 2, the low nibble for even i."""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int [N, W] in 0..15 (W even) -> uint8 [N, W / 2]."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """uint8 [M, W / 2] -> uint8 [M, W]."""
    return torch.stack((data & 15, data >> 4), dim=-1).reshape(data.shape[0], 2 * data.shape[1])
