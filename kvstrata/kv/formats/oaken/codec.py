"""Oaken's per-token quantization and its bit-exact fused dense-and-sparse packing.

Per token of width W (a multiple of 64), the dense record is
  W/2 bytes of nibbles (value i in byte i//2, low nibble for even i; an outlier's slot holds the low 4 bits
  of its 5-bit code, or 0 with float16 outliers) | G x (min, step) float16 little-endian, group 0 first |
  W/64 bytes: the number of outliers in each 64-value block.
Each outlier then has a sparse entry, in (block, index) order: for G <= 3 one byte
(code high bit << 7 | sparse slot << 6 | index in block), for G > 3 a little-endian uint16
(bit 15 code high bit, bits 8..10 sparse slot, bits 0..5 index); float16 outliers append the value's 2 bytes.

Decoded values and error bounds, per element, against the input x (plus float32 rounding of the shift):
  dense group: |x - x^| <= step/2. A shifted dense group has no side bit: the decoder reads the side from the
    sign of the decoded shifted value, so the encoder picks a grid with zero halfway between two codes (when
    the token has values on both sides) and nearest rounding keeps the side; where it would still cross zero
    (a value within float16 rounding of zero) the code moves by one, an error of at most one step; the side is
    lost only for x' = 0 on the low side with min = 0, an error of at most (hi_g - lo_g) of the dense group's
    own boundary;
  5-bit sparse groups: |x - x^| <= step/2 (the side is stored as the code's high bit);
  float16 outliers: x^ = float16(x), exact up to float16 rounding.
`step` is the float16 step of the element's (token or window, group) params.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv.formats.float16_params import params_from_bytes, params_to_bytes, round_float16
from kvstrata.kv.formats.nibbles import pack_nibbles, unpack_nibbles
from kvstrata.kv.formats.oaken.groups import (
    OakenConfig,
    ShiftTables,
    assign_groups,
    group_shift,
    shift_tables,
    validate_bounds,
)
from kvstrata.kv.kernels import paged_decode

BLOCK = 64  # values addressed by one 6-bit index
LEVELS = 15  # the largest 4-bit code
_FP16_MAX = 65504.0


@dataclass
class OakenEncoded:
    dense: torch.Tensor  # uint8 [N, dense_bytes]
    sparse: torch.Tensor  # uint8 [S]: all tokens' sparse entries, token after token
    sparse_bytes: torch.Tensor  # int32 [N]: bytes of each token's sparse entries
    meant: torch.Tensor  # float32 [N, W]: what decode_tokens returns for these records


def _check_width(width: int) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or width <= 0 or width % BLOCK:
        raise KvstrataError(f"Oaken token width {width!r} is not allowed; it must be a positive multiple of {BLOCK}")


def dense_bytes(width: int, config: OakenConfig) -> int:
    _check_width(width)
    return width // 2 + 4 * config.num_groups + width // BLOCK


def sparse_entry_bytes(config: OakenConfig) -> int:
    index_bytes = 1 if config.num_groups <= 3 else 2
    return index_bytes + (2 if config.outliers == "fp16" else 0)


@dataclass(frozen=True)
class _Prepared:
    """What encode and decode derive from (bounds, config) alone: built once per distinct pair and device, so a
    decode over a short context costs little beyond its own data. Never modified in place."""

    bounds: torch.Tensor  # validated float32 [G-1, 2]
    shift: ShiftTables
    dense_shift: tuple[torch.Tensor, torch.Tensor] | None  # (lo, hi) added back to dense values, if shifted
    levels: torch.Tensor  # float32 [16]: the codes 0..15
    slot_of_group: torch.Tensor  # uint8 [G]: a sparse group's slot in its entries (0 for the dense group)
    # Indexed by an entry's key: the top two bits (high bit, slot) of its byte for G <= 3, its second byte for G > 3;
    # keys no valid entry has map to group 0.
    key_group: torch.Tensor  # int64
    key_sign: torch.Tensor  # float32, +-1
    key_threshold: torch.Tensor  # float32, the threshold of the entry's side


@functools.lru_cache(maxsize=64)
def _prepared_for(
    config: OakenConfig, shape: tuple[int, ...], values: tuple[float, ...], device: torch.device
) -> _Prepared:
    b = validate_bounds(torch.tensor(values, dtype=torch.float64).view(shape), config).to(device)
    shift = shift_tables(b, config, device)
    g, dg = config.num_groups, config.dense_group
    slots = [0] * g
    size, key_shift = (4, 1) if g <= 3 else (256, 7)
    group, sign, threshold = [0] * size, [1.0] * size, [0.0] * size
    lo, hi = shift.lo.tolist(), shift.hi.tolist()
    for slot, sg in enumerate(config.sparse_groups):
        slots[sg] = slot
        for high_bit, side in ((0, hi), (1, lo)):
            key = (high_bit << key_shift) | slot
            group[key], sign[key], threshold[key] = sg, -1.0 if high_bit else 1.0, side[sg]
    shifted = config.group_shift and dg < g - 1
    return _Prepared(
        bounds=b,
        shift=shift,
        dense_shift=(shift.lo[dg], shift.hi[dg]) if shifted else None,
        levels=torch.arange(LEVELS + 1, dtype=torch.float32, device=device),
        slot_of_group=torch.tensor(slots, dtype=torch.uint8, device=device),
        key_group=torch.tensor(group, device=device),
        key_sign=torch.tensor(sign, dtype=torch.float32, device=device),
        key_threshold=torch.tensor(threshold, dtype=torch.float32, device=device),
    )


def _prepare(bounds: torch.Tensor, config: OakenConfig, device: torch.device) -> _Prepared:
    if not isinstance(bounds, torch.Tensor) or not bounds.is_floating_point():
        validate_bounds(bounds, config)  # raises: the message names what was given
    return _prepared_for(config, tuple(bounds.shape), tuple(bounds.detach().flatten().tolist()), device)


def reader_tables(bounds: torch.Tensor, config: OakenConfig, device: torch.device) -> tuple[list[torch.Tensor],
                                                                                            list[float]]:
    """What the compiled reader (kv/kernels/oaken_rows.cpp) needs beyond the records: the entry-key tables (group,
    sign, threshold) and the dense group's shift (shifted, lo, hi)."""
    prep = _prepare(bounds, config, device)
    shift = [0.0, 0.0, 0.0] if prep.dense_shift is None else [1.0, *(float(t) for t in prep.dense_shift)]
    return [prep.key_group, prep.key_sign, prep.key_threshold], shift


def _dense_lut(mn: torch.Tensor, st: torch.Tensor, prep: _Prepared) -> torch.Tensor:
    """[M, 16] decoded dense value of each code per token; the side is recovered from the shifted value's sign.

    Encoder and decoder both go through here, so they compute bit-identical float32 values.
    """
    lut = prep.levels * st[:, None] + mn[:, None]
    if prep.dense_shift is not None:
        lo, hi = prep.dense_shift
        lut += torch.where(lut >= 0, hi, lo)
    return lut


def _sparse_values(
    q: torch.Tensor, sign: torch.Tensor, mn: torch.Tensor, st: torch.Tensor, threshold: torch.Tensor
) -> torch.Tensor:
    """Decoded 5-bit sign-magnitude outliers: (-1)^s (min + q step), then the threshold of side s added back."""
    return (q.to(torch.float32) * st + mn) * sign + threshold


def _check_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        got = f"{x.dtype} tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise KvstrataError(f"Oaken encodes a float tensor [tokens, width], got {got}")
    _check_width(x.shape[1])
    x = x.detach().to(torch.float32).contiguous()
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        tokens = bad.any(1).nonzero().flatten().tolist()
        shown = ", ".join(map(str, tokens[:8])) + (", ..." if len(tokens) > 8 else "")
        raise KvstrataError(
            f"Oaken cannot encode {int(bad.sum())} NaN/inf value(s) in token(s) {shown}; all values must be finite"
        )
    return x


def _params(
    v: torch.Tensor, bucket: torch.Tensor, size: int, config: OakenConfig, straddle: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, step) float16 [size] over the values of each bucket; buckets >= size are ignored; empty ones get (0, 0).

    min is rounded down and step up to float16, so the encoder quantizes with exactly the stored numbers and no
    value needs a code above 15. Buckets marked in `straddle` (bool [size]: a shifted dense group) that hold values
    on both sides of zero get a grid with zero halfway between two codes (see `_zero_between_codes`).
    """
    g = config.num_groups
    keys, vals = bucket.flatten(), v.flatten()
    lo = torch.full((size + 1,), torch.inf, device=v.device).scatter_reduce_(0, keys, vals, "amin")[:size]
    hi = torch.full((size + 1,), -torch.inf, device=v.device).scatter_reduce_(0, keys, vals, "amax")[:size]
    empty = lo > hi
    lo, hi = torch.where(empty, 0.0, lo).double(), torch.where(empty, 0.0, hi).double()
    mn = round_float16(lo, -torch.inf)
    step = (hi - mn) / LEVELS
    if straddle is not None:
        both_sides = straddle & (lo < 0) & (hi > 0)
        mn[both_sides], step[both_sides] = _zero_between_codes(lo[both_sides], hi[both_sides])
    st = round_float16(step, torch.inf)
    bad = ~(torch.isfinite(mn) & torch.isfinite(st))
    if bool(bad.any()):
        i = bad.nonzero()[0].item()
        what = f"token {i // g}, group {i % g}" if config.scales == "token" else f"group {i}"
        raise KvstrataError(
            f"Oaken params of {what} (min {lo[i].item()!r}, max {hi[i].item()!r}) leave float16's "
            f"finite range; values must stay within +-{_FP16_MAX}"
        )
    return mn, st


def _zero_between_codes(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, step) of the finest grid over [lo, hi] (lo < 0 < hi) whose zero lies halfway between codes c and c + 1.

    The decoder reads a shifted dense value's side from the sign of its decoded value. On this grid every value
    below zero rounds to a code that decodes below zero and every value above to one above, so nearest rounding
    keeps the side and the error stays within half a step; a plain min-max grid would have to move a code by one
    (an error of up to a whole step) wherever rounding crosses zero. The step is at most 7.2% coarser than min-max's.
    min = -(c + 1/2) step, so the grid covers lo when step >= -lo / (c + 1/2) and hi when step >= hi / (14.5 - c).
    """
    c = torch.arange(LEVELS, dtype=lo.dtype, device=lo.device)
    steps = torch.maximum(-lo[:, None] / (c + 0.5), hi[:, None] / (LEVELS - 0.5 - c))
    step, best = steps.min(1)
    mn = round_float16(-(best + 0.5) * step, -torch.inf)
    # min rounded down may leave the top short of hi: the step then grows to reach it.
    return mn, torch.maximum(step, (hi - mn) / LEVELS)


def _keep_dense_side(q, v, mn_e, st_e, dense, low) -> torch.Tensor:
    """Move a shifted dense code by one where nearest rounding would cross zero: the decoder reads the side from
    the sign of the decoded value, so a value rounded across zero would get the other side's threshold (an error of
    the whole inner gap). The codes and layout are the paper's; only the encoder's rounding changes."""
    decoded = q * st_e + mn_e
    up = dense & ~low & (decoded < 0)  # high side, x' >= 0: the next code decodes to >= 0 (the max is >= x')
    down = dense & low & (decoded >= 0) & (q > 0)  # low side, x' <= 0
    return q + up.float() - down.float()


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def encode_tokens(x: torch.Tensor, bounds: torch.Tensor, config: OakenConfig) -> OakenEncoded:
    """Quantize and pack N tokens [N, W]; no sort or top-k, only comparisons against the thresholds."""
    x = _check_input(x)
    n, w = x.shape
    g, dg = config.num_groups, config.dense_group
    fp16 = config.outliers == "fp16"
    device = x.device
    prep = _prepare(bounds, config, device)
    groups = assign_groups(x, prep.bounds)
    xs, low = group_shift(x, groups, prep.shift)
    dense = groups == dg
    # Dense values keep their sign (the side is recovered from it); 5-bit outliers code the magnitude.
    v = torch.where(dense, xs, xs.abs())

    per_token = config.scales == "token"
    size = n * g if per_token else g
    bucket = groups + torch.arange(0, size, g, device=device)[:, None] if per_token else groups
    # float16 outliers need no params: their values go to a spare bucket that is dropped.
    straddle = None
    if prep.dense_shift is not None:
        straddle = torch.arange(size, device=device) % g == dg if per_token else torch.arange(g, device=device) == dg
    mn, st = _params(v, bucket.masked_fill(~dense, size) if fp16 else bucket, size, config, straddle)
    mn_e, st_e = _lookup(mn.float(), bucket), _lookup(st.float(), bucket)
    q = ((v - mn_e) / torch.where(st_e > 0, st_e, 1.0)).round_().clamp_(0, LEVELS)
    if prep.dense_shift is not None:
        q = _keep_dense_side(q, v, mn_e, st_e, dense, low)
    q = q.to(torch.uint8)
    if fp16:
        q.masked_fill_(~dense, 0)
    params = torch.stack((mn, st), -1).view(n if per_token else 1, g, 2).expand(n, g, 2)

    meant = _dense_lut(params[:, dg, 0].float(), params[:, dg, 1].float(), prep).gather(1, q.long())
    flat = (~dense).flatten().nonzero().flatten()  # row-major: token, then (block, index)
    og, olow = groups.flatten()[flat], low.flatten()[flat]
    if fp16:
        half = x.flatten()[flat].to(torch.float16)
        if not bool(torch.isfinite(half).all()):
            i = flat[~torch.isfinite(half)][0].item()
            raise KvstrataError(
                f"Oaken float16 outlier {x.flatten()[i].item()!r} of token {i // w} is outside +-{_FP16_MAX}"
            )
        values = half.float()
    else:
        sign = torch.where(olow, -1.0, 1.0)
        threshold = torch.where(olow, _lookup(prep.shift.lo, og), _lookup(prep.shift.hi, og))
        values = _sparse_values(q.flatten()[flat], sign, mn_e.flatten()[flat], st_e.flatten()[flat], threshold)
    meant.view(-1).index_copy_(0, flat, values)

    counts = (~dense).view(n, w // BLOCK, BLOCK).sum(-1, dtype=torch.uint8)
    record = torch.cat((pack_nibbles(q), params_to_bytes(params.reshape(n, 2 * g)), counts), 1)

    index = (flat % BLOCK).to(torch.uint8)
    slot = _lookup(prep.slot_of_group, og)
    high_bit = torch.zeros_like(index) if fp16 else olow.to(torch.uint8)
    if g <= 3:
        entries = (index | (slot << 6) | (high_bit << 7))[:, None]
    else:
        entries = torch.stack((index, slot | (high_bit << 7)), 1)
    if fp16:
        entries = torch.cat((entries, half.view(torch.uint8).view(-1, 2)), 1)
    sparse_bytes = counts.sum(1, dtype=torch.int32) * sparse_entry_bytes(config)
    return OakenEncoded(dense=record, sparse=entries.flatten(), sparse_bytes=sparse_bytes, meant=meant)


def encode_tokens_compiled(x: torch.Tensor, bounds: torch.Tensor,
                           config: OakenConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """encode_tokens' dense, sparse and sparse_bytes (int64), from the compiled encoder (kv/kernels/oaken_encode.cpp:
    the same bytes at a fraction of the cost of the ~250 small operations above). None where it does not apply
    (parameters per window, another device, no compiler) or a value leaves float16's range: encode_tokens then
    encodes, or raises the clear error."""
    kernel = paged_decode.kernel()
    if kernel is None or config.scales != "token" or x.device.type != "cpu":
        return None
    x = _check_input(x)
    encoded = kernel.oaken_encode(x, *encoder_tables(bounds, config, x.device))
    return None if encoded[0].numel() == 0 and len(x) else tuple(encoded)


def encoder_tables(bounds: torch.Tensor, config: OakenConfig,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """What the compiled encoder (kv/kernels/oaken_encode.cpp) takes beyond the values: bounds, shift lo and hi, the
    sparse slot of each group, and the layout [groups, dense group, dense group shifted, float16 outliers]."""
    prep = _prepare(bounds, config, device)
    layout = [config.num_groups, config.dense_group, int(prep.dense_shift is not None), int(config.outliers == "fp16")]
    return prep.bounds, prep.shift.lo, prep.shift.hi, prep.slot_of_group, layout


def decode_tokens(
    dense: torch.Tensor, sparse: torch.Tensor, bounds: torch.Tensor, config: OakenConfig, width: int
) -> torch.Tensor:
    """float32 [M, width] from M dense records and exactly those tokens' sparse entries, in order."""
    record = dense_bytes(width, config)
    if dense.dtype != torch.uint8 or dense.dim() != 2 or dense.shape[1] != record:
        raise KvstrataError(
            f"Oaken dense records must be uint8 [tokens, {record}], got {dense.dtype} {list(dense.shape)}"
        )
    if sparse.dtype != torch.uint8 or sparse.dim() != 1:
        raise KvstrataError(f"Oaken sparse entries must be a uint8 vector, got {sparse.dtype} {list(sparse.shape)}")
    m, g, dg, device = dense.shape[0], config.num_groups, config.dense_group, dense.device
    half, blocks = width // 2, width // BLOCK
    prep = _prepare(bounds, config, device)

    codes = unpack_nibbles(dense[:, :half])
    params = params_from_bytes(dense[:, half : half + 4 * g]).view(m, g, 2)
    counts = dense[:, half + 4 * g :]
    out = _dense_lut(params[:, dg, 0], params[:, dg, 1], prep).gather(1, codes.long())

    entry = sparse_entry_bytes(config)
    total = int(counts.sum())
    if sparse.numel() != total * entry:
        raise KvstrataError(
            f"Oaken sparse entries hold {sparse.numel()} bytes but the dense records count {total} outliers "
            f"of {entry} bytes each"
        )
    if total == 0:
        return out
    block = torch.arange(m * blocks, device=device).repeat_interleave(counts.flatten().long(), output_size=total)
    entries = sparse.reshape(total, entry)
    flat = block * BLOCK + (entries[:, 0] & 63)
    if config.outliers == "fp16":
        values = params_from_bytes(entries[:, -2:]).flatten()
    else:
        key = (entries[:, 0] >> 6 if g <= 3 else entries[:, 1]).long()
        # Row of each entry's (token, group) params: the block's token base plus the entry's group.
        token_base = torch.arange(0, m * g, g, device=device).repeat_interleave(blocks)
        row = token_base.index_select(0, block) + prep.key_group.index_select(0, key)
        p = params.view(m * g, 2).index_select(0, row)
        values = _sparse_values(
            codes.view(-1).index_select(0, flat),
            prep.key_sign.index_select(0, key),
            p[:, 0],
            p[:, 1],
            prep.key_threshold.index_select(0, key),
        )
    out.view(-1).index_copy_(0, flat, values)
    return out
