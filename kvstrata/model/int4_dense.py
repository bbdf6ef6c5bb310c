"""Products of many rows over int4 weights as dense bfloat16 GEMMs.

torch's packed int4 kernel reads a quarter of the bytes, which wins for a decode step's few rows; for a
prefill chunk oneDNN's bfloat16 GEMM (on a CPU with bfloat16 dot products, AVX512-BF16 or AMX) multiplies
1.5-2.6x faster (`python -m benchmarks.gemm_forms`). From `DENSE_FROM_ROWS` rows a layer's weights are
widened to bfloat16 for the call (model/kernels/int4_dense.cpp; 42-76 ms for all of the default model's
layers) into a scratch buffer per weight shape, and multiplied densely: the same weights as the kernel's,
rounded to bfloat16, and no resident copy.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch

from kvstrata.compiled_extension import load_extension

# from here the GEMM's gain pays for widening the weights (benchmarks/gemm_forms.py, widening included: 1.1x at
# 128 rows, 1.3-1.4x at 256 and 1,024; at 32 rows widening costs more than it saves)
DENSE_FROM_ROWS = 128
PACKED_ROWS = 64  # the packing interleaves blocks of 64 output rows (kernels/int4_dense.cpp)
TILE_COLUMNS = 32  # the widening kernel's tile: a group must span whole tiles


@functools.cache
def kernel():
    return load_extension("kvstrata_int4_dense", [Path(__file__).parent / "kernels" / "int4_dense.cpp"],
                          what="int4 widening")


def _native_bfloat16() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _layout_matches(compiled) -> bool:
    """The widening kernel reads torch's int4 packing as it is laid out in the torch versions it was written
    against; a probe matrix packed by torch itself must come back exactly, or the dense path stays off."""
    codes = torch.randint(0, 16, (2 * PACKED_ROWS, 2 * TILE_COLUMNS), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale_zero = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(2, codes.shape[0], 2).contiguous()
    out = torch.empty(codes.shape, dtype=torch.bfloat16)
    return torch.equal(compiled.int4pack_to_bfloat16(packed, scale_zero, TILE_COLUMNS, out).int(), codes)


@functools.cache
def available() -> bool:
    """Whether products of many rows take the dense path on this machine."""
    compiled = kernel() if _native_bfloat16() else None
    return compiled is not None and _layout_matches(compiled)


def supports(out_features: int, group_size: int) -> bool:
    return out_features % PACKED_ROWS == 0 and group_size % TILE_COLUMNS == 0


# One buffer per weight shape, reused by every layer; per thread, since a KV store's load thread may run the model
# (a stored prefix loaded layer by layer, engine/important_prefix_load.py) while the engine thread steps.
_scratch = threading.local()


def dense_weight(packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """bfloat16 [out, in] of a packed int4 weight, valid until the next call for a weight of its shape."""
    shape = (packed.shape[0], packed.shape[1] * 2)
    buffers = _scratch.__dict__.setdefault("by_shape", {})
    if shape not in buffers:
        buffers[shape] = torch.empty(shape, dtype=torch.bfloat16)
    return kernel().int4pack_to_bfloat16(packed, scale_zero, group_size, buffers[shape])
