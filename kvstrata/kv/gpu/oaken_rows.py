"""Oaken's records (kv/formats/oaken/codec.py) decoded by Triton: K or V of many tokens in one launch.

A program decodes ROWS tokens: first every value from the dense record (the dense group's 4-bit codes), then, after a
barrier, the outliers from the token's sparse entries, found through its block's sparse pages (kv/sparse_pages.py),
overwrite theirs. Keys get the model's mean key back, rotated to their position after RoPE where it was subtracted
there (kv/formats/oaken/format.py), from RoPE's tables as the torch path reads them; keys quantized before RoPE are not
read here (the torch path reads them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.kv.formats.oaken import codec
from kvstrata.kv.gpu.rounding import EXACT, float16_at
from kvstrata.kv.gpu.rows import ROWS, gathered_tile, store_tile

BLOCK = tl.constexpr(codec.BLOCK)  # values addressed by one entry's 6-bit index


@triton.jit
def mean_key_at(mean, cos, sin, position, channel, mask, HEAD_DIM: tl.constexpr, ROTATED: tl.constexpr):
    """The mean key's value at `channel`, rotated to `position` as RoPE rotates (halves layout) where ROTATED, with
    the angles' cos and sin read from RoPE's tables [positions, HEAD_DIM] (the ones the torch path reads)."""
    value = tl.load(mean + channel, mask=mask, other=0.0)
    if ROTATED:
        half: tl.constexpr = HEAD_DIM // 2
        within = channel % HEAD_DIM
        partner = tl.where(within < half, channel + half, channel - half)
        rotated = tl.load(mean + partner, mask=mask, other=0.0)
        rotated = tl.where(within < half, -rotated, rotated)
        angle = position.to(tl.int64) * HEAD_DIM + within
        cos_at = tl.load(cos + angle, mask=mask, other=0.0)
        value = value * cos_at + rotated * tl.load(sin + angle, mask=mask, other=0.0)
    return value


@triton.jit
def _oaken_decode(records, slots, positions, pages, block_pages, token_offset, token_count, key_group, key_sign,
                  key_threshold, mean, cos, sin, out, count, record_bytes, max_pages, shift_low, shift_high,
                  page_bytes, WIDTH: tl.constexpr, PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  GROUPS: tl.constexpr, DENSE_GROUP: tl.constexpr, SHIFTED: tl.constexpr, ENTRY_BYTES: tl.constexpr,
                  FLOAT16_OUTLIERS: tl.constexpr, ADD_MEAN: tl.constexpr, HEAD_DIM: tl.constexpr,
                  ROWS: tl.constexpr):
    rows, real, valid, position, slot = gathered_tile(slots, positions, count, ROWS)
    channels = tl.arange(0, PADDED)
    record = records + slot * record_bytes
    inside = valid[:, None] & (channels < WIDTH)[None, :]
    half: tl.constexpr = WIDTH // 2
    params = record + half + 4 * DENSE_GROUP

    # every value as the dense group's: code * step + min, the group's shift added back on the value's side
    packed = tl.load(record[:, None] + (channels // 2)[None, :], mask=inside, other=0).to(tl.int32)
    codes = (packed >> ((channels % 2) * 4)[None, :]) & 15
    values = codes.to(tl.float32) * float16_at(params + 2, valid)[:, None] + float16_at(params, valid)[:, None]
    if SHIFTED:
        values += tl.where(values >= 0, shift_high, shift_low)
    if ADD_MEAN:
        values += mean_key_at(mean, cos, sin, position[:, None], channels[None, :], inside, HEAD_DIM, ADD_MEAN == 2)
    store_tile(out, rows, real, valid, channels, values, WIDTH)
    tl.debug_barrier()  # the outliers below overwrite values stored above, maybe by other threads

    # entry e of a token belongs to the 64-value block b whose running outlier count first exceeds e
    entries = tl.arange(0, PADDED)
    entry_count = tl.load(token_count + slot, mask=valid, other=0).to(tl.int32) // ENTRY_BYTES
    present = valid[:, None] & (entries[None, :] < entry_count[:, None])
    value_block = tl.zeros((ROWS, PADDED), dtype=tl.int32)
    running = tl.zeros((ROWS,), dtype=tl.int32)
    for b in tl.static_range(WIDTH // BLOCK):
        running += tl.load(record + half + 4 * GROUPS + b, mask=valid, other=0).to(tl.int32)
        value_block += (entries[None, :] >= running[:, None]).to(tl.int32)
    start = tl.load(token_offset + slot, mask=valid, other=0).to(tl.int64)[:, None] + entries[None, :] * ENTRY_BYTES
    first = _sparse_byte(pages, block_pages, slot, start, present, max_pages, page_bytes, BLOCK_SIZE)
    channel = value_block * BLOCK + (first & 63)
    if FLOAT16_OUTLIERS:
        low = _sparse_byte(pages, block_pages, slot, start + ENTRY_BYTES - 2, present, max_pages, page_bytes,
                           BLOCK_SIZE)
        high = _sparse_byte(pages, block_pages, slot, start + ENTRY_BYTES - 1, present, max_pages, page_bytes,
                            BLOCK_SIZE)
        outliers = (low.to(tl.uint16) | (high.to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        if GROUPS <= 3:
            key = first >> 6
        else:
            key = _sparse_byte(pages, block_pages, slot, start + 1, present, max_pages, page_bytes, BLOCK_SIZE)
        group = tl.load(key_group + key, mask=present, other=0)
        packed = tl.load(record[:, None] + channel // 2, mask=present, other=0).to(tl.int32)
        code = (packed >> ((channel % 2) * 4)) & 15
        group_params = record[:, None] + half + 4 * group
        outliers = code.to(tl.float32) * float16_at(group_params + 2, present) + float16_at(group_params, present)
        outliers = outliers * tl.load(key_sign + key, mask=present, other=1.0) + \
            tl.load(key_threshold + key, mask=present, other=0.0)
    if ADD_MEAN:
        outliers += mean_key_at(mean, cos, sin, position[:, None], channel, present, HEAD_DIM, ADD_MEAN == 2)
    tl.store(out + rows[:, None].to(tl.int64) * WIDTH + channel, outliers.to(out.dtype.element_ty), mask=present)


@triton.jit
def _sparse_byte(pages, block_pages, slot, logical, mask, max_pages, page_bytes, BLOCK_SIZE: tl.constexpr):
    """The byte at `logical` offset within the sparse pages of the block of `slot` ([ROWS] slots, [ROWS, E] offsets)."""
    page = tl.load(block_pages + (slot // BLOCK_SIZE)[:, None] * max_pages + logical // page_bytes, mask=mask, other=0)
    return tl.load(pages + page * page_bytes + logical % page_bytes, mask=mask, other=0).to(tl.int32)


def oaken_decode(records: torch.Tensor, pages: list[torch.Tensor], tables: list[torch.Tensor], shift: list[float],
                 layout: dict, mean: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values [M, width] of the tokens at `slots` [M] (positions [M]; -1: padding, zeros) from one layer's dense
    records [slots, record_bytes] and sparse `pages` (SparsePages.layer_tensors). `tables` and `shift` are the
    format's reader tables (kv/formats/oaken/codec.py reader_tables); `layout` names width, block_size, groups,
    dense_group, entry_bytes, float16_outliers, page_bytes, add_mean (0, 1, or 2: rotated to the position) and
    head_dim; `mean` [width] and RoPE's cos and sin tables [positions, head_dim] (covering every position) serve
    add_mean."""
    width = layout["width"]
    out = torch.empty(len(slots), width, dtype=dtype, device=records.device)
    if not len(slots):
        return out
    data, block_pages, token_offset, token_count = pages
    _oaken_decode[(triton.cdiv(len(slots), ROWS),)](
        records, slots.contiguous(), positions.contiguous(), data, block_pages, token_offset, token_count, *tables,
        mean, cos, sin, out, len(slots), records.shape[1], block_pages.shape[1], shift[1], shift[2],
        layout["page_bytes"], width,
        triton.next_power_of_2(width), layout["block_size"], layout["groups"], layout["dense_group"],
        bool(shift[0]), layout["entry_bytes"], layout["float16_outliers"], layout["add_mean"], layout["head_dim"],
        ROWS, **EXACT)
    return out
