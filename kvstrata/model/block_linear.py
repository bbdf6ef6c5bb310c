"""Linear layers over weights kept as GGUF ships them, in blocks of 32 columns, run by kvstrata's integer dot
products (model/kernels/block_dot.cpp).

A decode step multiplies a few rows of activations by every weight. torch's int4 kernel widens each weight to
float first, which on a 2-core CPU makes the step bound by arithmetic; the compiled kernel instead quantizes each
row of activations to int8 per block of 32 (as llama.cpp does) and takes one integer dot product per block, so the
step reads the weights about as fast as memory delivers them. 4-bit blocks (GGUF Q4_0 / Q4_1: code * scale + min)
and signed 8-bit blocks (Q8_0: code * scale) are both kept as shipped. Where the CPU has no AVX-512 VNNI, products
of 4 to 127 rows (batched decode steps) widen each weight row once into a small float32 buffer and multiply every
row there, inside the same kernel (model/kernels/widened_rows.cpp). Products of many rows (prefill chunks) widen a
layer's weights for the call and run a dense GEMM: in bfloat16 where the CPU multiplies bfloat16 natively, in
float32 elsewhere (on an AVX2 CPU, widening included, 1.4x the dot products' rate at 128 rows, 2.3x at 1,024).
Without a compiler, or for other layouts, the layers run on torch's int4 kernel (quantized_linear.Int4Linear).
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn

from kvstrata.compiled_extension import load_extension, switches_set
from kvstrata.model.group_quantized import GroupQuantized

BLOCK = 32
# from here a dense GEMM's gain pays for widening the weights (benchmarks/gemm_forms.py: bfloat16 1.1x at 128 rows,
# 1.3-1.4x at 256 and 1,024 against torch's int4 kernel, which the dot products match at 32 rows; float32 on an
# AVX2 CPU in docs/BENCHMARKS.md, "Prefill-sized products without bfloat16 dot products")
DENSE_FROM_ROWS = 128


@functools.cache
def kernel():
    compiled = load_extension("kvstrata_weight_kernels")
    if compiled is not None:
        _register_fakes()
    return compiled


def _register_fakes() -> None:
    """Output shapes for torch.compile's tracing, so a compiled step keeps the products inside its graph."""

    @torch.library.register_fake("kvstrata_weights::block_linear")
    def _(x, codes, scales, mins, bits):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("kvstrata_weights::block_to_dense")
    def _(codes, scales, mins, bits, out):
        return None


def kernel_paths(avx512: bool, widened_rows: bool):
    """Within it, the compiled kernel may take (where the CPU allows) its AVX-512 dot products, and its widened rows
    from 4 rows where the dot products are AVX2's: for tests and benchmarks that check or time one path."""
    ops = torch.ops.kvstrata_weights
    return switches_set((ops.allow_avx512, avx512), (ops.allow_widened_rows, widened_rows))


def fits(weight) -> bool:
    """Whether `weight` is kept as is by the kernel: 4-bit codes with offsets or signed 8-bit codes, blocks of 32."""
    return (isinstance(weight, GroupQuantized) and weight.group_size == BLOCK
            and ((weight.bits == 4 and weight.offsets is not None) or (weight.bits == 8 and weight.offsets is None)))


@functools.cache
def widened_dtype() -> torch.dtype:
    """What products of many rows widen the weights to: bfloat16 where the CPU has bfloat16 dot products (without
    them oneDNN's bfloat16 GEMM is several times slower than float32's), float32 elsewhere."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native else torch.float32


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in [0, 16) as [N, K / 2] bytes: per block, column j in the low nibble of byte j and column
    16 + j in its high nibble (GGUF's order)."""
    rows, cols = codes.shape
    halves = codes.view(rows, cols // BLOCK, 2, BLOCK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def _exact_in_half(values: torch.Tensor) -> bool:
    """Whether float16 holds `values` exactly, as it does GGUF's block scales and mins (stored as float16): the
    kernel then reads them as float16, 2 bytes per block instead of 4. Scales quantized at load stay float32."""
    return torch.equal(values.to(torch.float16).to(values.dtype), values)


# One widening buffer per weight shape, reused by every layer; per thread, since a KV store's load thread may run
# the model (a stored prefix loaded layer by layer, engine/important_prefix_load.py) while the engine thread steps.
_scratch = threading.local()


class BlockLinear(nn.Module):
    """y = x W^T + b, W in blocks of 32 columns: 4-bit codes with a scale and a min, or signed 8-bit codes with a
    scale."""

    def __init__(self, weight: GroupQuantized, bias: torch.Tensor | None):
        super().__init__()
        if not fits(weight):
            raise ValueError(f"no block layout for {weight.bits}-bit codes in groups of {weight.group_size}")
        self.out_features, self.in_features = weight.shape
        self.bits = weight.bits
        self.register_buffer("codes", _nibbles(weight.codes) if self.bits == 4 else weight.codes.contiguous())
        mins = weight.offsets if self.bits == 4 else torch.empty(0)
        dtype = torch.float16 if all(_exact_in_half(t) for t in (weight.scales, mins)) else torch.float32
        self.register_buffer("scales", weight.scales.to(dtype).contiguous())
        self.register_buffer("mins", mins.to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def kind(self) -> str:
        return f"int{self.bits} blocks"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if len(flat) >= DENSE_FROM_ROWS:
            weight = self._dense_weight()
            out = flat.to(weight.dtype) @ weight.t()
        else:
            out = torch.ops.kvstrata_weights.block_linear(flat.float(), self.codes, self.scales, self.mins, self.bits)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def _dense_weight(self) -> torch.Tensor:
        """The weights as widened_dtype() [out, in], valid until the next call for a weight of this shape on this
        thread."""
        shape = (self.out_features, self.in_features)
        buffers = _scratch.__dict__.setdefault("by_shape", {})
        if shape not in buffers:
            buffers[shape] = torch.empty(shape, dtype=widened_dtype())
        torch.ops.kvstrata_weights.block_to_dense(self.codes, self.scales, self.mins, self.bits, buffers[shape])
        return buffers[shape]
