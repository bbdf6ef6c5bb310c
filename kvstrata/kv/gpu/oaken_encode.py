"""Oaken's encoder (kv/formats/oaken/codec.py, scales per token) in Triton: one launch encodes one layer's K or V of
every token of a step, writes each dense record at its slot and puts the token's sparse entries in a scratch row,
from which kv/gpu/sparse_append.py appends them to the sparse pages.

One program per token. Every rounding is the torch encoder's: float32 for values and codes, float64 for the groups'
ranges and steps, float16 minimums rounded down and steps up, half to even, no fused multiply-add. Keys have the mean
key taken off first, rotated to their position where it was, with the cos and sin of RoPE's tables that the torch
path reads. Where a value is NaN or leaves float16's range the torch encoder raises; this one stores NaN parameters
(or an infinite float16 outlier), and the request fails alone when attention reads them, as for an int8 or int4
record.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.kv.formats.oaken import codec
from kvstrata.kv.gpu.oaken_rows import BLOCK, mean_key_at
from kvstrata.kv.gpu.rounding import EXACT, float16_toward, has_nan, round_half_even, store_float16

LEVELS = tl.constexpr(codec.LEVELS)  # the largest 4-bit code


@triton.jit
def _zero_between_codes(low, high):
    """codec._zero_between_codes for one group (float64): the finest grid over [low, high] with zero halfway between
    two codes, the first of the best when several tie."""
    step = low * 0.0 + float("inf")
    best = low * 0.0
    for c in tl.static_range(LEVELS):
        candidate = tl.maximum(-low / (c + 0.5), high / (LEVELS - 0.5 - c))
        better = candidate < step
        step = tl.where(better, candidate, step)
        best = tl.where(better, c * 1.0, best)
    minimum = float16_toward(-(best + 0.5) * step, False)
    return minimum, tl.maximum(step, (high - minimum.to(tl.float64)) / LEVELS)


@triton.jit
def _oaken_encode(x, positions, slots, records, entries, entry_bytes, bounds, shift_low, shift_high, slot_of_group,
                  mean, cos, sin, record_bytes, max_token_bytes, WIDTH: tl.constexpr, PADDED: tl.constexpr,
                  GROUPS: tl.constexpr, DENSE_GROUP: tl.constexpr, SHIFTED: tl.constexpr,
                  FLOAT16_OUTLIERS: tl.constexpr, ENTRY_BYTES: tl.constexpr, ADD_MEAN: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    channels = tl.arange(0, PADDED)
    inside = channels < WIDTH
    values = tl.load(x + token * WIDTH + channels, mask=inside, other=0.0)
    if ADD_MEAN:
        position = tl.load(positions + token)
        values = values - mean_key_at(mean, cos, sin, position, channels, inside, HEAD_DIM, ADD_MEAN == 2)
    not_a_number = has_nan(values, 0)  # the torch encoder refuses NaN; here the token's parameters become NaN

    # group by the thresholds, the shifted value and its side (groups.assign_groups, groups.group_shift)
    group = tl.zeros((PADDED,), dtype=tl.int32)
    for k in tl.static_range(GROUPS - 1):
        group += ((values > tl.load(bounds + 2 * k)) & (values < tl.load(bounds + 2 * k + 1))).to(tl.int32)
    high_shift = tl.load(shift_high + group)
    low = values < high_shift
    shifted = values - tl.where(low, tl.load(shift_low + group), high_shift)
    dense = group == DENSE_GROUP
    v = tl.where(dense, shifted, tl.abs(shifted))

    # each group's float16 (min, step) over its values (codec._params); float16 outliers need none
    counted = inside & (dense | (not FLOAT16_OUTLIERS))
    record = records + tl.load(slots + token).to(tl.int64) * record_bytes
    half: tl.constexpr = WIDTH // 2
    minimum = tl.zeros((PADDED,), dtype=tl.float32)
    step = tl.zeros((PADDED,), dtype=tl.float32)
    for g in tl.static_range(GROUPS):
        member = counted & (group == g)
        low_g = tl.min(tl.where(member, v, float("inf")), axis=0)
        high_g = tl.max(tl.where(member, v, -float("inf")), axis=0)
        empty = low_g > high_g
        low_g = tl.where(empty, 0.0, low_g).to(tl.float64)
        high_g = tl.where(empty, 0.0, high_g).to(tl.float64)
        min_g = float16_toward(low_g, False)
        step_g = (high_g - min_g.to(tl.float64)) / LEVELS
        if SHIFTED and g == DENSE_GROUP:
            zero_min, zero_step = _zero_between_codes(low_g, high_g)
            both_sides = (low_g < 0) & (high_g > 0)
            min_g = tl.where(both_sides, zero_min, min_g)
            step_g = tl.where(both_sides, zero_step, step_g)
        step_g = float16_toward(step_g, True)
        min_g = tl.where(not_a_number, float("nan"), min_g)
        store_float16(record + half + 4 * g, min_g, True)
        store_float16(record + half + 4 * g + 2, step_g, True)
        minimum = tl.where(group == g, min_g.to(tl.float32), minimum)
        step = tl.where(group == g, step_g.to(tl.float32), step)

    # codes, kept on their side of zero in a shifted dense group (codec._keep_dense_side)
    codes = round_half_even(tl.math.div_rn(v - minimum, tl.where(step > 0, step, 1.0)))
    codes = tl.minimum(tl.maximum(codes, 0.0), 15.0)
    if SHIFTED:
        decoded = codes * step + minimum
        codes += (dense & ~low & (decoded < 0)).to(tl.float32)
        codes -= (dense & low & (decoded >= 0) & (codes > 0)).to(tl.float32)
    outlier = inside & ~dense
    codes = codes.to(tl.int32)
    if FLOAT16_OUTLIERS:
        codes = tl.where(outlier, 0, codes)
    pairs = tl.reshape(codes, (PADDED // 2, 2))
    packed = tl.sum(pairs << (4 * tl.arange(0, 2))[None, :], axis=1)
    pair = tl.arange(0, PADDED // 2)
    tl.store(record + pair, packed.to(tl.uint8), mask=2 * pair < WIDTH)
    for b in tl.static_range(WIDTH // BLOCK):
        in_block = outlier & (channels // BLOCK == b)
        tl.store(record + half + 4 * GROUPS + b, tl.sum(in_block.to(tl.int32), axis=0).to(tl.uint8))

    # one entry per outlier, in channel order: (index, sparse slot, side), then the float16 value where kept so
    rank = tl.cumsum(outlier.to(tl.int32), axis=0) - outlier.to(tl.int32)
    slot = tl.load(slot_of_group + group, mask=outlier, other=0).to(tl.int32)
    side = 0 if FLOAT16_OUTLIERS else low.to(tl.int32)
    destination = entries + token * max_token_bytes + rank * ENTRY_BYTES
    if GROUPS <= 3:
        tl.store(destination, ((channels % BLOCK) | (slot << 6) | (side << 7)).to(tl.uint8), mask=outlier)
    else:
        tl.store(destination, (channels % BLOCK).to(tl.uint8), mask=outlier)
        tl.store(destination + 1, (slot | (side << 7)).to(tl.uint8), mask=outlier)
    if FLOAT16_OUTLIERS:
        store_float16(destination + ENTRY_BYTES - 2, values.to(tl.float16), outlier)
    tl.store(entry_bytes + token, tl.sum(outlier.to(tl.int32), axis=0) * ENTRY_BYTES)


def oaken_encode(x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, records: torch.Tensor,
                 tables: tuple, layout: dict, mean: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode float32 x [N, width] (tokens at `positions` [N]) and write their dense records at `slots` [N] of one
    layer's `records`; returns their sparse entries, one scratch row [N, width * entry_bytes] per token, and each
    token's count of entry bytes (int32 [N]). `tables` are the encoder's (codec.encoder_tables: bounds, shift lo,
    shift hi, slot of group, [groups, dense group, dense group shifted, float16 outliers]); `layout` names
    entry_bytes, add_mean (0, 1, or 2: rotated to the position) and head_dim; `mean` [width] and RoPE's cos and sin
    tables [positions, head_dim] serve add_mean."""
    width = x.shape[1]
    bounds, shift_low, shift_high, slot_of_group, (groups, dense_group, shifted, float16_outliers) = tables
    max_token_bytes = width * layout["entry_bytes"]
    entries = torch.empty(len(x), max_token_bytes, dtype=torch.uint8, device=x.device)
    entry_bytes = torch.empty(len(x), dtype=torch.int32, device=x.device)
    if len(x):
        _oaken_encode[(len(x),)](
            x, positions.contiguous(), slots.contiguous(), records, entries, entry_bytes, bounds, shift_low, shift_high,
            slot_of_group, mean, cos, sin, records.shape[1], max_token_bytes, width, triton.next_power_of_2(width),
            groups, dense_group, bool(shifted), bool(float16_outliers), layout["entry_bytes"], layout["add_mean"],
            layout["head_dim"],
            **EXACT)
    return entries, entry_bytes
