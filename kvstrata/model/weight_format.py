"""`--weights`: the form the linear layers' weights take on the compute device.

auto  keeps a checkpoint's own quantization where a kernel runs it exactly on the device (GGUF Q4_0 /
      Q4_1 / Q8_0 blocks of 32 on kvstrata's integer dot products, model/block_linear.py, or without a
      compiler on torch's int4 kernel, Q8_0 as two int4 planes; CPU only so far) and otherwise uses --dtype;
fp32, bf16, fp16  dequantize (or cast) every linear layer's weight to that dtype;
int8  one symmetric int8 scale per output row, quantized at load (lossy for any source);
int4  asymmetric 4-bit codes per group of 32 columns: GGUF 4-bit blocks repacked exactly, anything
      else quantized at load (lossy).
Norms, biases and the rest of the model stay in --dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from kvstrata.errors import KvstrataError
from kvstrata.model import block_linear
from kvstrata.model.group_quantized import GroupQuantized
from kvstrata.model.quantized_linear import CastLinear, Int4Linear, Int8Linear, QuantizedEmbedding, group_quantize

WEIGHT_FORMATS = ("auto", "fp32", "bf16", "fp16", "int8", "int4")
FLOAT_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KERNEL_FORMATS = ("int8", "int4")
INT4_GROUP_SIZE = 32


def check_weight_format(weights: str, device: torch.device) -> None:
    if weights not in WEIGHT_FORMATS:
        raise KvstrataError(f"--weights {weights!r} is not known; choose one of {', '.join(WEIGHT_FORMATS)}")
    if weights in KERNEL_FORMATS and device.type != "cpu":
        raise KvstrataError(f"--weights {weights} runs on torch's CPU kernels only so far, not on {device.type}; "
                            "use --weights auto or a float format (fp32, bf16, fp16) there")


def _integer_linear(weight: GroupQuantized, bias) -> nn.Module:
    """The fastest module that runs `weight` (blocks of 32) exactly: the compiled block kernels, else torch's int4
    kernel."""
    if block_linear.kernel() is not None:
        return block_linear.BlockLinear(weight, bias)
    return Int4Linear(weight, bias)


def dense_weight(weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, GroupQuantized) else weight


def build_linear(weight, bias, weights: str, device: torch.device, dtype: torch.dtype) -> nn.Module | None:
    """The module for one linear layer's weight in format `weights`; None keeps a plain nn.Linear in
    `dtype` (the caller then loads the dense weight into it)."""
    if weights == "auto":
        if device.type == "cpu" and block_linear.fits(weight):
            return _integer_linear(weight, bias)
        return None
    if weights == "int4":
        exact = block_linear.fits(weight) and weight.bits == 4
        return _integer_linear(weight if exact else group_quantize(dense_weight(weight), 4, INT4_GROUP_SIZE), bias)
    if weights == "int8":
        return Int8Linear(dense_weight(weight), bias)
    if FLOAT_FORMATS[weights] == dtype:
        return None
    return CastLinear(dense_weight(weight).to(FLOAT_FORMATS[weights]), bias).to(device)


def build_embedding(weight, weights: str, device: torch.device, dtype: torch.dtype) -> nn.Module | None:
    """Quantized embeddings stay quantized (only looked-up rows are decoded) unless a float format was
    asked for; None keeps a plain nn.Embedding."""
    if isinstance(weight, GroupQuantized) and weights not in FLOAT_FORMATS and device.type == "cpu":
        return QuantizedEmbedding(weight, dtype)
    return None


def module_kind(module: nn.Module, dtype: torch.dtype) -> str:
    return getattr(module, "kind", str(dtype).removeprefix("torch."))
