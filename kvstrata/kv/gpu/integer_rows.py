"""int8 and int4 records (kv/formats/integer.py) decoded and encoded by Triton, one launch per layer and K/V.

A program of a decode handles ROWS tokens (kv/gpu/rows.py) and writes each token's values, in the caller's dtype;
padding rows (position -1) come back as zeros. Encoding writes the same bytes as the torch encoder (the tests hold
them equal); a token holding NaN gets NaN parameters, as torch's amax and amin give them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.kv.gpu.rounding import EXACT, float16_at, float16_toward, has_nan, round_half_even, store_float16
from kvstrata.kv.gpu.rows import ROWS, gathered_tile, store_tile


@triton.jit
def _int8_decode(records, slots, positions, out, count, record_bytes, WIDTH: tl.constexpr, PADDED: tl.constexpr,
                 ROWS: tl.constexpr):
    rows, real, valid, _, slot = gathered_tile(slots, positions, count, ROWS)
    base = slot * record_bytes
    channels = tl.arange(0, PADDED)
    inside = valid[:, None] & (channels < WIDTH)[None, :]
    codes = tl.load(records + base[:, None] + channels[None, :], mask=inside, other=0).to(tl.int8, bitcast=True)
    scale = float16_at(records + base + WIDTH, valid)
    store_tile(out, rows, real, valid, channels, codes.to(tl.float32) * scale[:, None], WIDTH)


@triton.jit
def _int8_encode(x, slots, records, count, record_bytes, WIDTH: tl.constexpr, PADDED: tl.constexpr,
                 ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    channels = tl.arange(0, PADDED)
    real = rows < count
    inside = real[:, None] & (channels < WIDTH)[None, :]
    values = tl.load(x + rows[:, None].to(tl.int64) * WIDTH + channels[None, :], mask=inside, other=0.0)
    scale = float16_toward(tl.math.div_rn(tl.max(tl.abs(values), axis=1), 127.0), True)
    scale = tl.where(has_nan(values, 1), float("nan"), scale)  # as torch's amax gives it
    safe = tl.where(scale > 0, scale.to(tl.float32), 1.0)
    codes = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(values, safe[:, None])), -127.0), 127.0)
    base = tl.load(slots + rows, mask=real, other=0).to(tl.int64) * record_bytes
    tl.store(records + base[:, None] + channels[None, :], codes.to(tl.int8).to(tl.uint8, bitcast=True), mask=inside)
    store_float16(records + base + WIDTH, scale, real)


@triton.jit
def _int4_decode(records, slots, positions, out, count, record_bytes, WIDTH: tl.constexpr, PADDED: tl.constexpr,
                 GROUP: tl.constexpr, CODE_BYTES: tl.constexpr, ROWS: tl.constexpr):
    rows, real, valid, _, slot = gathered_tile(slots, positions, count, ROWS)
    base = slot * record_bytes
    channels = tl.arange(0, PADDED)
    inside = valid[:, None] & (channels < WIDTH)[None, :]
    packed = tl.load(records + base[:, None] + (channels // 2)[None, :], mask=inside, other=0).to(tl.int32)
    codes = (packed >> ((channels % 2) * 4)[None, :]) & 15
    params = records + base[:, None] + CODE_BYTES + 4 * (channels // GROUP)[None, :]
    low = float16_at(params, inside)
    step = float16_at(params + 2, inside)
    store_tile(out, rows, real, valid, channels, low + codes.to(tl.float32) * step, WIDTH)


@triton.jit
def _int4_encode(x, slots, records, WIDTH: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                 GROUPS_PADDED: tl.constexpr, CODE_BYTES: tl.constexpr, RECORD_BYTES: tl.constexpr):
    """One token per program, as [groups, GROUP / 2] pairs of (even, odd) values: a byte holds one pair's codes. A
    short last group is padded with copies of the token's last value, as the torch encoder pads it."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, GROUPS_PADDED)
    pairs = tl.arange(0, GROUP // 2)
    even = groups[:, None] * GROUP + 2 * pairs[None, :]
    real = (groups < GROUPS)[:, None] & (pairs >= 0)[None, :]  # (pairs >= 0: every pair, broadcast to the tile)
    first = tl.load(x + row * WIDTH + tl.minimum(even, WIDTH - 1), mask=real, other=0.0)
    second = tl.load(x + row * WIDTH + tl.minimum(even + 1, WIDTH - 1), mask=real, other=0.0)
    inf = float("inf")
    low = tl.min(tl.minimum(tl.where(real, first, inf), tl.where(real, second, inf)), axis=1)
    high = tl.max(tl.maximum(tl.where(real, first, -inf), tl.where(real, second, -inf)), axis=1)
    low = float16_toward(tl.where(groups < GROUPS, low, 0.0), False)  # the padding groups' are never stored
    low = tl.where(has_nan(first, 1) | has_nan(second, 1), float("nan"), low)  # as torch's amin gives it
    step = float16_toward(tl.math.div_rn(high - low.to(tl.float32), 15.0), True)
    safe = tl.where(step > 0, step.to(tl.float32), 1.0)[:, None]
    low32 = low.to(tl.float32)[:, None]
    code_first = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(first - low32, safe)), 0.0), 15.0)
    code_second = tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(second - low32, safe)), 0.0), 15.0)
    packed = code_first.to(tl.uint8) | (code_second.to(tl.uint8) << 4)
    base = tl.load(slots + row).to(tl.int64) * RECORD_BYTES
    byte = even // 2
    tl.store(records + base + byte, packed, mask=real & (byte < CODE_BYTES))
    store_float16(records + base + CODE_BYTES + 4 * groups, low, groups < GROUPS)
    store_float16(records + base + CODE_BYTES + 4 * groups + 2, step, groups < GROUPS)


def int8_decode(records: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, width: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Values [M, width] of the tokens at `slots` [M] (positions [M]; -1: padding, zeros) from one layer's int8
    records [slots, width + 2]."""
    out = torch.empty(len(slots), width, dtype=dtype, device=records.device)
    if len(slots):
        _int8_decode[(triton.cdiv(len(slots), ROWS),)](records, slots.contiguous(), positions.contiguous(), out,
                                                       len(slots), records.shape[1], width,
                                                       triton.next_power_of_2(width), ROWS, **EXACT)
    return out


def int8_encode(x: torch.Tensor, slots: torch.Tensor, records: torch.Tensor) -> None:
    """Encode float32 x [N, width] and write the records at `slots` [N] of one layer's records."""
    if len(x):
        _int8_encode[(triton.cdiv(len(x), ROWS),)](x, slots.contiguous(), records, len(x), records.shape[1], x.shape[1],
                                                   triton.next_power_of_2(x.shape[1]), ROWS, **EXACT)


def int4_decode(records: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, width: int, group: int,
                code_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """As `int8_decode`, from int4 records (nibbles, then a float16 minimum and step per group of `group` values)."""
    out = torch.empty(len(slots), width, dtype=dtype, device=records.device)
    if len(slots):
        _int4_decode[(triton.cdiv(len(slots), ROWS),)](records, slots.contiguous(), positions.contiguous(), out,
                                                       len(slots), records.shape[1], width,
                                                       triton.next_power_of_2(width), group, code_bytes, ROWS, **EXACT)
    return out


def int4_encode(x: torch.Tensor, slots: torch.Tensor, records: torch.Tensor, group: int, code_bytes: int) -> None:
    """As `int8_encode`, into int4 records."""
    groups = -(-x.shape[1] // group)
    if len(x):
        _int4_encode[(len(x),)](x, slots.contiguous(), records, x.shape[1], group, groups,
                                triton.next_power_of_2(groups), code_bytes, records.shape[1], **EXACT)
