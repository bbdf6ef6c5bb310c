"""Triton kernels for quantized KV on a GPU: each reads (or writes) a layer's records for many tokens in one launch.

On a GPU a small model's step is bound by launching work, not by doing it: the torch path decodes a gathered token
with dozens of small operations per layer (kv/formats: unpack, parameters from bytes, multiply, add, select), each a
kernel launch, so quantized KV cost more per step than it saved in memory (docs/BENCHMARKS.md, the capacity
benchmark on CUDA). These kernels do a format's whole decode, or encode and write, in a launch or two per layer and K/V
(Oaken's write: encode, then append the outlier entries to the sparse pages).

They run where `runs_on(device)` says: a CUDA device with Triton installed (torch's CUDA wheels bring it). Elsewhere the
storage takes its torch path (and on the CPU its compiled C++ kernels). The tests run them on the CPU in Triton's
interpreter (TRITON_INTERPRET=1, set by tests/conftest.py where no GPU is present) against the torch path.
"""

from __future__ import annotations

import importlib.util

import torch


def runs_on(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None
