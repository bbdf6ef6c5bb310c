"""Linear layers over packed integer weights, run by torch's CPU kernels.

`Int4Linear` calls `_weight_int4pack_mm_for_cpu` (groups of columns, value (q - 8) * scale + zero): GGUF's blocks
take it where kvstrata's own kernels cannot be built (block_linear.py runs them otherwise);
`Int8Linear` calls `_weight_int8pack_mm` (one scale per output row). Both kernels are fast on
bfloat16 activations only (with float32 ones the int4 kernel is many times slower on this CPU), so
activations are cast to bfloat16 for the product and back afterwards; scales are bfloat16 too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.model.block_linear import BlockLinear
from kvstrata.model.group_quantized import GroupQuantized

KERNEL_DTYPE = torch.bfloat16


def group_quantize(weight: torch.Tensor, bits: int, group_size: int) -> GroupQuantized:
    """Asymmetric min/max codes in [0, 2**bits) per group of `group_size` columns. Unlike the KV formats'
    quantizer (kv/formats/asymmetric.py), the (min, step) pairs stay float32: the kernel rounds them once,
    to bfloat16, and a float16 rounding before it measurably moved the int4 head's perplexity."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"{cols} input features are not a multiple of the group size {group_size}")
    grouped = weight.float().view(rows, cols // group_size, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = ((high - low) / (2**bits - 1)).clamp(min=1e-12)
    codes = ((grouped - low.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, 2**bits - 1)
    return GroupQuantized(codes.to(torch.uint8).view(rows, cols), scales, low, bits, group_size)


def _int4_planes(weight: GroupQuantized) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Codes and (scale, zero) of the int4 matrices whose sum is `weight`, exactly.

    4-bit codes q with offset m: q * s + m = (q - 8) * s + (m + 8 s), one plane. Signed 8-bit codes
    c = 16 h + l (h in [-8, 8), l in [0, 16)): c * s = (h + 8 - 8) * 16 s + (l - 8) * s + 8 s, two planes.
    """
    if weight.bits == 4 and weight.offsets is not None:
        return [(weight.codes.int(), torch.stack([weight.scales, weight.offsets + 8 * weight.scales], -1))]
    if weight.bits == 8 and weight.offsets is None:
        codes = weight.codes.int()
        high, low = torch.div(codes, 16, rounding_mode="floor"), torch.remainder(codes, 16)
        zeros = torch.zeros_like(weight.scales)
        return [(high + 8, torch.stack([16 * weight.scales, zeros], -1)),
                (low, torch.stack([weight.scales, 8 * weight.scales], -1))]
    raise ValueError(f"no int4 layout for {weight.bits}-bit {'asymmetric' if weight.offsets is not None else 'symmetric'} codes")


class Int4Linear(nn.Module):
    """y = x W^T + b, W the sum of one or two packed int4 planes (two for 8-bit codes)."""

    def __init__(self, weight: GroupQuantized, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        planes = _int4_planes(weight)
        self.planes = len(planes)
        self.buffer_names = [(f"packed{index}", f"scale_zero{index}") for index in range(self.planes)]
        for (packed_name, scale_zero_name), (codes, scale_zero) in zip(self.buffer_names, planes):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
            # The kernel wants (scale, zero) as [K / group, N, 2].
            self.register_buffer(packed_name, packed)
            self.register_buffer(scale_zero_name, scale_zero.transpose(0, 1).contiguous().to(KERNEL_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def kind(self) -> str:
        return "int4" if self.planes == 1 else "int8 as two int4 planes"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        out = None
        for packed_name, scale_zero_name in self.buffer_names:
            plane = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, getattr(self, packed_name), self.group_size, getattr(self, scale_zero_name)
            ).to(x.dtype)
            out = plane if out is None else out + plane
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(x.dtype)


class Int8Linear(nn.Module):
    """y = x W^T + b, W int8 with one symmetric scale per output row."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        scales = (weight.float().abs().amax(1) / 127).clamp(min=1e-12)
        self.register_buffer("codes", (weight.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(KERNEL_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)
        out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)


class CastLinear(nn.Module):
    """y = x W^T + b with W in a dtype other than the activations' (e.g. bfloat16 weights, float32 activations)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(weight.dtype), requires_grad=False)

    @property
    def kind(self) -> str:
        return str(self.weight.dtype).removeprefix("torch.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


# weights only integer kernels read (no gradient)
KERNEL_LINEARS = (Int4Linear, Int8Linear, BlockLinear)


class QuantizedEmbedding(nn.Module):
    """Token embeddings kept as group-quantized codes; the looked-up rows are decoded on the fly."""

    def __init__(self, weight: GroupQuantized, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.bits, self.group_size = dtype, weight.bits, weight.group_size
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("offsets", weight.offsets)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        offsets = None if self.offsets is None else self.offsets[ids.reshape(-1)]
        rows = GroupQuantized(self.codes[ids.reshape(-1)], self.scales[ids.reshape(-1)], offsets, self.bits,
                              self.group_size)
        return rows.dequantize(self.dtype).view(*ids.shape, -1)
