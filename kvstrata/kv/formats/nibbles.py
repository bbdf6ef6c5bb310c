"""Small codes packed into bytes: with b bits (2 or 4), value i sits in byte i // (8 / b), at bit
b * (i mod 8 / b); for 4 bits, the low nibble holds the even value."""

from __future__ import annotations

import torch


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int [N, W] in 0 .. 2^bits - 1 (W a multiple of 8 / bits) -> uint8 [N, W * bits / 8]."""
    per_byte = 8 // bits
    codes = codes.to(torch.uint8)
    packed = codes[:, 0::per_byte].clone()
    for i in range(1, per_byte):
        packed |= codes[:, i::per_byte] << (bits * i)
    return packed


def unpack_codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [M, B] -> uint8 [M, B * 8 / bits]."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    parts = [(data >> (bits * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(data.shape[0], data.shape[1] * per_byte)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return pack_codes(codes, 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    return unpack_codes(data, 4)
