"""A weight matrix kept as it is shipped: integer codes with one scale (and offset) per group of columns.

GGUF's Q4_0, Q4_1 and Q8_0 blocks are all of this shape, 32 values a block, and so are the eight groups of a
Q4_K super-block (value = (d * scale) * code - dmin * min), so they are read into `GroupQuantized` without loss:
value = code * scale + offset (offset absent for symmetric codes). The loader keeps this form until it knows
which kernel will run the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class GroupQuantized:
    codes: torch.Tensor  # [N, K]: uint8 in [0, 2**bits) (asymmetric) or int8 (symmetric)
    scales: torch.Tensor  # [N, K / group_size] float32
    offsets: torch.Tensor | None  # [N, K / group_size] float32, or None for symmetric codes
    bits: int
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.codes.shape
        grouped = self.codes.view(rows, cols // self.group_size, self.group_size).float()
        values = grouped * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            values = values + self.offsets.unsqueeze(-1)
        return values.view(rows, cols).to(dtype)

    def sample(self, count: int) -> torch.Tensor:
        """The first and last `count` values of the flattened dequantized matrix (rows decoded on demand)."""
        rows_needed = -(-count // self.codes.shape[1])
        head = self.select_rows(slice(0, rows_needed)).dequantize().reshape(-1)[:count]
        tail = self.select_rows(slice(-rows_needed, None)).dequantize().reshape(-1)[-count:]
        return torch.cat([head, tail])

    def select_rows(self, index) -> GroupQuantized:
        offsets = None if self.offsets is None else self.offsets[index]
        return GroupQuantized(self.codes[index], self.scales[index], offsets, self.bits, self.group_size)


def scale_rows(weight: torch.Tensor | GroupQuantized, factors: torch.Tensor) -> torch.Tensor | GroupQuantized:
    """`weight` with each row (or value, for a bias) multiplied by its one of `factors`; a quantized one keeps its
    codes, its scales and offsets multiplied."""
    if isinstance(weight, torch.Tensor):
        return weight * (factors if weight.dim() == 1 else factors[:, None]).to(weight.dtype)
    offsets = None if weight.offsets is None else weight.offsets * factors[:, None]
    return GroupQuantized(weight.codes, weight.scales * factors[:, None], offsets, weight.bits, weight.group_size)


def cat_rows(parts: list) -> torch.Tensor | GroupQuantized:
    """Stack matrices along their output rows (fusing q/k/v or gate/up). Quantized parts stay
    quantized when they share their layout; parts in GGUF blocks of different kinds (a "Q4_K_M" file's 4-bit q
    and k beside its 6-bit v) are fused as Q8_0, the finest of them, each part quantized again; any other mix falls
    back to float32."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    same = all(isinstance(p, GroupQuantized) and (p.bits, p.group_size, p.offsets is None)
               == (first.bits, first.group_size, first.offsets is None) for p in parts)
    if not same and all(isinstance(p, GroupQuantized) and p.group_size == GGUF_BLOCK for p in parts):
        parts = [p if (p.bits, p.offsets) == (8, None) else as_q8_0(p.dequantize()) for p in parts]
        first, same = parts[0], True
    if not same:
        return torch.cat([p.dequantize() if isinstance(p, GroupQuantized) else p.float() for p in parts])
    offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts])
    return GroupQuantized(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), offsets,
                          first.bits, first.group_size)


# GGUF block layouts (ggml): Q4_0 = fp16 d + 16 bytes of nibbles, value d * (q - 8); Q4_1 = fp16 d,
# fp16 m + 16 bytes, value d * q + m; Q8_0 = fp16 d + 32 int8, value d * q. In a 4-bit block, byte j
# holds value j in its low nibble and value j + 16 in its high nibble.
GGUF_BLOCK = 32


def _nibbles(block_bytes: np.ndarray) -> np.ndarray:
    low, high = block_bytes & 0x0F, block_bytes >> 4
    return np.concatenate([low, high], axis=-1)


def from_gguf_blocks(raw: np.ndarray, type_name: str) -> GroupQuantized:
    """Read a GGUF tensor's raw rows ([N, row bytes] uint8) of type Q4_0, Q4_1 or Q8_0."""
    header = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[type_name]
    payload = 32 if type_name == "Q8_0" else 16
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, header + payload)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        codes = blocks[..., header:].copy().view(np.int8).reshape(rows, -1)
        return GroupQuantized(torch.from_numpy(codes), torch.from_numpy(d), None, 8, GGUF_BLOCK)
    codes = _nibbles(blocks[..., header:]).reshape(rows, -1)
    if type_name == "Q4_1":
        offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:  # Q4_0: d * (q - 8) = d * q - 8 d
        offsets = -8.0 * d
    return GroupQuantized(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(d),
                          torch.from_numpy(offsets), 4, GGUF_BLOCK)


def as_q8_0(values: torch.Tensor) -> GroupQuantized:
    """Float rows quantized as GGUF's Q8_0 (signed 8-bit codes, a float16 scale per 32 values), by the gguf
    package's own quantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return from_gguf_blocks(quantize(values.float().numpy(), GGMLQuantizationType.Q8_0), "Q8_0")


Q4_K_BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes: 256 values


def from_q4_k_blocks(raw: np.ndarray) -> GroupQuantized:
    """Read a GGUF tensor's raw Q4_K rows ([N, row bytes] uint8) as 4-bit groups of 32: group j of a super-block
    has scale d * scale_j and offset -dmin * min_j (both exact in float32), its codes the low nibbles of 32 bytes
    (groups 0, 2, 4, 6) or their high ones (groups 1, 3, 5, 7)."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, Q4_K_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    group_scales, group_mins = Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each
    shifted = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (shifted & 0x0F).reshape(rows, -1)
    scales = (d * group_scales.astype(np.float32)).reshape(rows, -1)
    offsets = -(dmin * group_mins.astype(np.float32)).reshape(rows, -1)
    return GroupQuantized(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scales),
                          torch.from_numpy(offsets), 4, GGUF_BLOCK)
