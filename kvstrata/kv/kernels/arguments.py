"""Tensors in the form the compiled kernels take them (contiguous, of one dtype), converted only where they are not:
a decode step passes each layer's store a handful of tensors that already are, and every conversion torch is asked
for costs its dispatch even when it returns the tensor unchanged. And the kernels' whole-block reads in the form the
KV seam hands K and V over."""

from __future__ import annotations

import torch


def contiguous_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`, contiguous: `x` itself where it already is."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


def float32_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, ...] as contiguous float32 [n, width]."""
    return contiguous_as(x.reshape(x.shape[0], -1), torch.float32)


def int64_rows(x: torch.Tensor) -> torch.Tensor:
    """Slots or positions as contiguous int64."""
    return contiguous_as(x, torch.int64)


def whole_block_rows(read: list[torch.Tensor], kv_shape: tuple[int, int],
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A compiled reader's K and V [n, T, width] (paged_read_*) as [n, T, kv_heads, head_dim] in `dtype`."""
    k, v = read
    return k.view(*k.shape[:2], *kv_shape).to(dtype), v.view(*v.shape[:2], *kv_shape).to(dtype)
