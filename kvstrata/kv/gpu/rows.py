"""What the readers share: a program's tile of gathered tokens, and storing their decoded values."""

from __future__ import annotations

import triton
import triton.language as tl

ROWS = 16  # gathered tokens per program


@triton.jit
def gathered_tile(slots, positions, count, ROWS: tl.constexpr):
    """This program's ROWS tokens of a gather of `count`: their index, which exist (real), which are not padding
    (valid: position >= 0), their positions and slots (int64; padding at position 0, slot 0)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    real = rows < count
    position = tl.load(positions + rows, mask=real, other=-1)
    valid = real & (position >= 0)
    slot = tl.load(slots + rows, mask=valid, other=0).to(tl.int64)
    return rows, real, valid, tl.maximum(position, 0), slot


@triton.jit
def store_tile(out, rows, real, valid, channels, values, WIDTH: tl.constexpr):
    """The tile's values [ROWS, channels] into rows of out [count, WIDTH], in out's dtype; padding rows as zeros."""
    values = tl.where(valid[:, None], values, 0.0)
    tl.store(out + rows[:, None].to(tl.int64) * WIDTH + channels[None, :], values.to(out.dtype.element_ty),
             mask=real[:, None] & (channels < WIDTH)[None, :])
