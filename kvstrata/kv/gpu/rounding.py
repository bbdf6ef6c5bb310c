"""What the format kernels share to round as the torch path rounds: float16 parameters kept as two little-endian bytes
in a uint8 record (kv/formats/float16_params.py), float16 rounding toward a side, rounding half to even, and launches
that keep every product apart from the sum after it."""

from __future__ import annotations

import triton
import triton.language as tl

from kvstrata.kv.formats import float16_params

FLOAT16_MAX = tl.constexpr(float16_params.FLOAT16_MAX)
# Launch option of every kernel here that computes: no fused multiply-add, which rounds a product and a sum
# once where torch's separate operations round twice (an encoder would otherwise pick another code, now and then).
EXACT = {"enable_fp_fusion": False}


@triton.jit
def float16_at(pointer, mask):
    """The float16 in the two bytes at `pointer` (low byte first), as float32; 0 where `mask` is false."""
    low = tl.load(pointer, mask=mask, other=0).to(tl.uint16)
    high = tl.load(pointer + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def store_float16(pointer, value, mask):
    """Store float16 `value` as two bytes at `pointer`, low byte first."""
    bits = value.to(tl.uint16, bitcast=True)
    tl.store(pointer, (bits & 255).to(tl.uint8), mask=mask)
    tl.store(pointer + 1, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def float16_toward(x, up: tl.constexpr):
    """`float16_up` (up) or `float16_down` of x (float32 or float64): the nearest float16 on that side, NaN beyond
    float16's range (kv/formats/float16_params.py). float64 goes through float32 first, as the compiled CPU encoder
    does; a result on the wrong side moves one step."""
    nearest = x.to(tl.float32).to(tl.float16)
    bits = nearest.to(tl.int16, bitcast=True)
    if up:
        wrong = nearest.to(x.dtype) < x
        # one float16 step toward +inf: the magnitude grows for +0 and positive values, shrinks for negative ones
        bits = tl.where(wrong, tl.where(bits >= 0, bits + 1, bits - 1), bits)
    else:
        wrong = nearest.to(x.dtype) > x
        # toward -inf: the magnitude shrinks for positive values and grows for negative ones and -0 (x < +0 never
        # rounds to +0)
        bits = tl.where(wrong, tl.where(bits > 0, bits - 1, bits + 1), bits)
    rounded = bits.to(tl.float16, bitcast=True)
    return tl.where(tl.abs(x) <= FLOAT16_MAX, rounded, float("nan"))


@triton.jit
def round_half_even(x):
    """torch.round: halves go to the even neighbour."""
    below = tl.floor(x)
    fraction = x - below
    odd = (below - 2.0 * tl.floor(below * 0.5)) == 1.0
    return tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), below + 1.0, below)


@triton.jit
def has_nan(x, axis: tl.constexpr):
    """Whether x holds a NaN along `axis`: on a GPU tl.max and tl.min skip NaN, where torch's amax and amin return
    it."""
    return tl.max((x != x).to(tl.int32), axis=axis) > 0  # noqa: PLR0124 (NaN alone differs from itself)
