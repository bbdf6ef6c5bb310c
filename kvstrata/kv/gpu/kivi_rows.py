"""KIVI's cache (kv/kivi_cache.py) decoded by Triton: K and V of many tokens in one launch each.

A token is read from its block's full-precision window slot while the block has one (`read_window`), else from its
codes: a key channel's minimum and step are its block's, a value's those of its token's group of channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.kv.gpu.rounding import EXACT
from kvstrata.kv.gpu.rows import ROWS, store_tile


@triton.jit
def _kivi_decode(codes, parameters, window, read_window, slots, out, count, code_bytes, groups_per_token,
                 BLOCK_SIZE: tl.constexpr, WIDTH: tl.constexpr, PADDED: tl.constexpr, BITS: tl.constexpr,
                 PER_BLOCK: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """PER_BLOCK: params per block channel (keys: params [blocks, WIDTH, 2]); else per token and group of GROUP
    channels (values: params [slots, WIDTH / GROUP, 2])."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    channels = tl.arange(0, PADDED)
    real = rows < count
    inside = real[:, None] & (channels < WIDTH)[None, :]
    slot = tl.load(slots + rows, mask=real, other=0).to(tl.int64)
    block = slot // BLOCK_SIZE
    per_byte: tl.constexpr = 8 // BITS
    packed = tl.load(codes + slot[:, None] * code_bytes + (channels // per_byte)[None, :], mask=inside, other=0)
    code = (packed.to(tl.int32) >> (BITS * (channels % per_byte))[None, :]) & ((1 << BITS) - 1)
    if PER_BLOCK:
        param = parameters + (block[:, None] * WIDTH + channels[None, :]) * 2
    else:
        param = parameters + (slot[:, None] * groups_per_token + (channels // GROUP)[None, :]) * 2
    low = tl.load(param, mask=inside, other=0.0).to(tl.float32)
    step = tl.load(param + 1, mask=inside, other=0.0).to(tl.float32)
    values = low + code.to(tl.float32) * step
    window_slot = tl.load(read_window + block, mask=real, other=-1)
    young = window_slot >= 0
    recent = window + ((window_slot * BLOCK_SIZE + slot % BLOCK_SIZE) * WIDTH)[:, None] + channels[None, :]
    values = tl.where(young[:, None], tl.load(recent, mask=inside & young[:, None], other=0.0).to(tl.float32), values)
    store_tile(out, rows, real, real, channels, values, WIDTH)  # padding rows read any slot: kept as read


def kivi_decode(codes: torch.Tensor, params: torch.Tensor, window: torch.Tensor, read_window: torch.Tensor,
                slots: torch.Tensor, bits: int, value_group: int | None, dtype: torch.dtype) -> torch.Tensor:
    """One layer's keys (value_group None: params [blocks, width, 2] per block channel) or values (params [slots,
    width / value_group, 2]) [M, width] of the tokens at `slots` [M]; codes [slots, width * bits / 8], the window
    [window slots, block_size, width] and each block's window slot `read_window` [blocks] (-1: quantized)."""
    width = window.shape[-1]
    out = torch.empty(len(slots), width, dtype=dtype, device=codes.device)
    if len(slots):
        _kivi_decode[(triton.cdiv(len(slots), ROWS),)](
            codes, params, window, read_window, slots.contiguous(), out, len(slots), codes.shape[1],
            0 if value_group is None else params.shape[1], window.shape[1], width, triton.next_power_of_2(width), bits,
            value_group is None, value_group or 1, ROWS, **EXACT)
    return out
