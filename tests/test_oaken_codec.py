"""Oaken codec: bit-exact decode, per-group error bounds, the packed byte layout, edge cases and checks."""

from __future__ import annotations

import itertools
import json
import struct

import pytest
import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv.formats.oaken import codec
from kvstrata.kv.formats.oaken.codec import decode_tokens, dense_bytes, encode_tokens, sparse_entry_bytes
from kvstrata.kv.formats.oaken.groups import OakenConfig, assign_groups
from kvstrata.kv.kernels import paged_decode

RATIOS = [
    (0.5, 0.5),
    (0.04, 0.90, 0.06),  # the paper's default
    (0.7, 0.2, 0.1),  # dense group outermost
    (0.1, 0.2, 0.7),  # dense group innermost (never shifted)
    (0.3, 0.4, 0.3),
    (0.02, 0.03, 0.90, 0.05),
    (0.01, 0.02, 0.90, 0.03, 0.04),
    (0.2, 0.2, 0.2, 0.2, 0.2),  # tie: the outermost is dense
]
CONFIGS = [
    OakenConfig(ratios=r, group_shift=shift, outliers=out, scales=scales)
    for r, shift, out, scales in itertools.product(RATIOS, (True, False), ("5bit", "fp16"), ("token", "window"))
]
WIDTHS = (64, 128, 192)
DEFAULT_BOUNDS = torch.tensor([[-2.0, 2.0], [-0.5, 0.5]])


def _id(config: OakenConfig) -> str:
    ratios = "-".join(f"{r:g}" for r in config.ratios)
    return f"{ratios}|{'shift' if config.group_shift else 'noshift'}|{config.outliers}|{config.scales}"


def kv(tokens: int, width: int, seed: int) -> torch.Tensor:
    """Gaussian values with a few heavy channels and a spike token, like a real K cache."""
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed))
    x[:, 3::17] *= 6
    x[tokens // 2] *= 3
    return x


def calibrated_bounds(config: OakenConfig, width: int, seed: int) -> torch.Tensor:
    """Thresholds as the calibrator computes them, on a separate sample of the same distribution."""
    flat = kv(48, width, seed + 1000).flatten()
    rows = [
        (torch.quantile(flat, a / 2, interpolation="lower"), torch.quantile(flat, 1 - a / 2, interpolation="higher"))
        for a in config.boundary_fractions
    ]
    return torch.tensor(rows, dtype=torch.float32)


def sample(config: OakenConfig, width: int, seed: int, tokens: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    x = kv(tokens, width, seed)
    b = calibrated_bounds(config, width, seed)
    # Values exactly on every threshold exercise the boundary conventions.
    x[0, : b.numel()] = b.flatten()
    return x, b


def record_params(dense: torch.Tensor, width: int, config: OakenConfig) -> torch.Tensor:
    """float32 [N, G, 2] (min, step) read back from the records."""
    start = width // 2
    raw = dense[:, start : start + 4 * config.num_groups].contiguous().view(torch.float16)
    return raw.float().view(dense.shape[0], config.num_groups, 2)


def nibbles(dense: torch.Tensor, width: int) -> torch.Tensor:
    packed = dense[:, : width // 2]
    return torch.stack((packed & 15, packed >> 4), -1).reshape(dense.shape[0], width)


def roundtrip(x: torch.Tensor, b: torch.Tensor, config: OakenConfig) -> codec.OakenEncoded:
    enc = encode_tokens(x, b, config)
    n, w = x.shape
    assert enc.dense.dtype == torch.uint8 and enc.dense.shape == (n, dense_bytes(w, config))
    assert enc.sparse.dtype == torch.uint8 and enc.sparse.dim() == 1
    assert enc.sparse_bytes.dtype == torch.int32 and enc.sparse_bytes.shape == (n,)
    assert int(enc.sparse_bytes.sum()) == enc.sparse.numel()
    assert enc.meant.dtype == torch.float32 and enc.meant.shape == (n, w)
    counts = enc.dense[:, -w // 64 :].long()
    assert torch.equal(counts.sum(1) * sparse_entry_bytes(config), enc.sparse_bytes.long())
    decoded = decode_tokens(enc.dense, enc.sparse, b, config, w)
    assert torch.equal(decoded, enc.meant)
    return enc


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_decode_reproduces_meant_bit_exactly(config):
    for seed, width in enumerate(WIDTHS):
        x, b = sample(config, width, seed)
        enc = roundtrip(x, b, config)
        if config.scales == "window":
            params = record_params(enc.dense, width, config)
            assert torch.equal(params, params[:1].expand_as(params))


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_error_bounds_per_group(config):
    for seed, width in enumerate(WIDTHS):
        x, b = sample(config, width, seed + 10)
        enc = roundtrip(x, b, config)
        check_error_bounds(x, b, config, enc)


def check_error_bounds(x: torch.Tensor, b: torch.Tensor, config: OakenConfig, enc: codec.OakenEncoded) -> None:
    w = x.shape[1]
    groups = assign_groups(x, b)
    params = record_params(enc.dense, w, config)
    step = params[:, :, 1].gather(1, groups)
    err = (enc.meant - x).abs()
    # float32 rounding of the shift and of min + q * step
    tol = 2.0**-20 * (x.abs() + b.abs().max())
    dg = config.dense_group
    dense = groups == dg
    bound = step / 2 + tol
    if config.group_shift and dg < config.num_groups - 1:
        lo, hi = b[dg].tolist()
        high = x >= hi
        shifted = x - torch.where(high, hi, lo)
        decoded_shifted = params[:, dg, 0:1] + nibbles(enc.dense, w).float() * params[:, dg, 1:2]
        wrong_side = dense & ((decoded_shifted >= 0) != high)
        # The encoder keeps the side: only a value exactly on the low threshold with a zero minimum may lose it.
        assert bool((shifted[wrong_side] == 0).all() and (params[:, dg, 0:1].expand_as(x)[wrong_side] == 0).all())
        # With values on both sides the grid puts zero halfway between two codes, up to min's float16 rounding, so
        # nearest rounding keeps the side; a value within that rounding of zero may have its code moved by one.
        mn = params[:, dg, 0:1].expand_as(x)
        straddles = (shifted.masked_fill(~dense, 0).amin(1, keepdim=True) < 0) & (
            shifted.masked_fill(~dense, 0).amax(1, keepdim=True) > 0)
        if config.scales == "window":
            straddles = straddles.any(0, keepdim=True)
        moved = dense & ~wrong_side & ((decoded_shifted - shifted).abs() > step / 2 + tol)
        near_zero = shifted.abs() <= 2.0**-9 * mn.abs() + tol
        assert bool((~moved | ~straddles | near_zero).all()), "a code was moved away from nearest rounding"
        bound = bound + wrong_side * (hi - lo) + moved * step / 2
    assert bool((err[dense] <= bound[dense]).all()), (err - bound)[dense].max()
    outliers = ~dense
    if config.outliers == "fp16":
        assert torch.equal(enc.meant[outliers], x[outliers].half().float())
        assert bool((nibbles(enc.dense, w)[outliers] == 0).all())
    else:
        assert bool((err[outliers] <= bound[outliers]).all()), (err - bound)[outliers].max()


@pytest.mark.parametrize(
    "config", [OakenConfig(), OakenConfig(ratios=(0.02, 0.03, 0.9, 0.05), outliers="fp16")], ids=_id
)
def test_concatenated_batches_decode_like_each_batch(config):
    x1, b = sample(config, 128, 3, tokens=5)
    x2 = kv(7, 128, 4) * 1.5
    e1, e2 = encode_tokens(x1, b, config), encode_tokens(x2, b, config)
    both = decode_tokens(torch.cat((e1.dense, e2.dense)), torch.cat((e1.sparse, e2.sparse)), b, config, 128)
    assert torch.equal(both, torch.cat((e1.meant, e2.meant)))
    # A token in the middle decodes alone from its own slice of the sparse bytes.
    offsets = torch.cat((torch.zeros(1, dtype=torch.int64), e2.sparse_bytes.long().cumsum(0)))
    alone = decode_tokens(e2.dense[3:4], e2.sparse[offsets[3] : offsets[4]], b, config, 128)
    assert torch.equal(alone, e2.meant[3:4])


def test_packed_layout_by_hand():
    """W = 64, default groups: middle is dense; outer is sparse slot 0, inner slot 1."""
    config = OakenConfig()
    x = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)[None].clone()  # dense: x' = +-0.5
    x[0, 0], x[0, 1], x[0, 5], x[0, 10] = 3.0, -0.25, -4.0, 0.25
    enc = roundtrip(x, DEFAULT_BOUNDS, config)
    assert dense_bytes(64, config) == 32 + 12 + 1 == enc.dense.shape[1]
    row = enc.dense[0].tolist()
    # Nibbles: even dense 1.0 -> code 15, odd dense -1.0 -> code 0. Outer 3.0: x' = 1 = its group's min -> 0;
    # outer -4.0: |x'| = 2 = max -> 15; inner +-0.25: constant magnitude -> 0.
    expected_nibbles = [0x0F] * 32
    expected_nibbles[0] = 0x00  # positions 0 (outer, code 0) and 1 (inner, code 0)
    expected_nibbles[2] = 0xFF  # positions 4 (dense 15) and 5 (outer, low 4 bits of 0b11111)
    expected_nibbles[5] = 0x00  # positions 10 (inner, 0) and 11 (dense 0)
    assert row[:32] == expected_nibbles
    # float16 little-endian: outer (min 1.0, step 1/15 rounded up = 0x2C45), middle (-0.5, 0x2C45), inner (0.25, 0)
    assert row[32:44] == [0x00, 0x3C, 0x45, 0x2C, 0x00, 0xB8, 0x45, 0x2C, 0x00, 0x34, 0x00, 0x00]
    assert struct.unpack("<e", bytes([0x45, 0x2C]))[0] >= 1 / 15 > struct.unpack("<e", bytes([0x44, 0x2C]))[0]
    assert row[44:] == [4]
    # Entries in index order: sign << 7 | slot << 6 | index
    assert enc.sparse.tolist() == [0x00, (1 << 7) | (1 << 6) | 1, (1 << 7) | 5, (1 << 6) | 10]
    assert enc.sparse_bytes.tolist() == [4]
    step = struct.unpack("<e", bytes([0x45, 0x2C]))[0]
    meant = enc.meant[0]
    assert meant[0].item() == 3.0 and meant[1].item() == -0.25 and meant[10].item() == 0.25 and meant[3].item() == -1.0
    assert meant[5].item() == pytest.approx(-(1.0 + 15 * step) - 2.0)
    assert meant[2].item() == pytest.approx(-0.5 + 15 * step + 0.5)


def test_two_byte_and_fp16_entries_by_hand():
    # G = 4: groups 0, 1, 3 are sparse (slots 0, 1, 2); a uint16 entry has the high bit at 15, slot at 8..10.
    config = OakenConfig(ratios=(0.02, 0.03, 0.9, 0.05))
    b = torch.tensor([[-4.0, 4.0], [-2.0, 2.0], [-0.5, 0.5]])
    x = torch.full((1, 128), 1.0)
    x[0, 64 + 7] = -0.25  # innermost, low side, block 1 index 7
    x[0, 3] = 3.0  # group 1, high side, block 0 index 3
    enc = roundtrip(x, b, config)
    assert sparse_entry_bytes(config) == 2
    assert enc.sparse.tolist() == [3, 1, 7, 0x80 | 2]
    assert enc.dense[0, -2:].tolist() == [1, 1]
    # float16 outliers: entry byte with a zero code bit, then the value; dense slots hold 0.
    config = OakenConfig(outliers="fp16")
    x = torch.full((1, 64), 1.0)
    x[0, 0], x[0, 5] = 3.0, -4.0
    enc = roundtrip(x, DEFAULT_BOUNDS, config)
    assert sparse_entry_bytes(config) == 3
    assert enc.sparse.tolist() == [0x00, 0x00, 0x42, 0x05, 0x00, 0xC4]
    assert enc.dense[0, 0].item() & 15 == 0 and enc.dense[0, 2].item() >> 4 == 0
    assert enc.meant[0, 0].item() == 3.0 and enc.meant[0, 5].item() == -4.0
    assert enc.dense[0, 32:36].tolist() == [0, 0, 0, 0]  # no params for float16 outlier groups


def test_default_payload_is_4_8_bits_on_ten_percent_outliers():
    config = OakenConfig()
    tokens, width = 6, 320
    gen = torch.Generator().manual_seed(7)
    x = (torch.rand(tokens, width, generator=gen) + 0.6) * torch.where(
        torch.rand(tokens, width, generator=gen) < 0.5, 1, -1
    )
    for t in range(tokens):
        chosen = torch.randperm(width, generator=gen)[: width // 10]  # exactly 10% outliers
        x[t, chosen[:12]] = 3.0 + torch.rand(12, generator=gen)
        x[t, chosen[12:]] = 0.01 * torch.randn(width // 10 - 12, generator=gen)
    enc = roundtrip(x, DEFAULT_BOUNDS, config)
    assert enc.sparse.numel() == tokens * width // 10
    payload_bits = 8 * (enc.dense[:, : width // 2].numel() + enc.sparse.numel()) / x.numel()
    assert payload_bits == pytest.approx(4.8, abs=1e-12)
    total_bits = 8 * (enc.dense.numel() + enc.sparse.numel()) / x.numel()
    assert total_bits == pytest.approx(4.8 + 8 * (4 * 3 + width // 64) / width, abs=1e-12)


@pytest.mark.parametrize("group", [0, 1, 2])
def test_all_values_in_one_group(group):
    config = OakenConfig()
    base = torch.rand(4, 128, generator=torch.Generator().manual_seed(group))
    sign = torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)
    x = (base * [1.0, 1.0, 0.4][group] + [2.0, 0.5, 0.0][group]) * sign
    assert bool((assign_groups(x, DEFAULT_BOUNDS) == group).all())
    enc = roundtrip(x, DEFAULT_BOUNDS, config)
    check_error_bounds(x, DEFAULT_BOUNDS, config, enc)
    counts = enc.dense[:, -2:]
    # Sparse groups make every 64-value block entirely outliers.
    assert bool((counts == (0 if group == config.dense_group else 64)).all())
    params = record_params(enc.dense, 128, config)
    others = [g for g in range(3) if g != group]
    assert bool((params[:, others] == 0).all())  # empty groups store (0, 0)


def test_blocks_made_entirely_of_outliers_and_tokens_without_any():
    config = OakenConfig()
    x = kv(3, 192, 5).clamp(-1.9, 1.9)
    x[x.abs() < 0.6] = 1.0  # token 1 has no outliers at all
    x[0, 64:128] = torch.linspace(2.5, 9.0, 64)  # block 1 of token 0: all outer
    x[2, :64] = torch.linspace(-0.4, 0.4, 64)  # block 0 of token 2: all inner
    enc = roundtrip(x, DEFAULT_BOUNDS, config)
    check_error_bounds(x, DEFAULT_BOUNDS, config, enc)
    assert enc.dense[0, -3:].tolist() == [0, 64, 0] and enc.dense[2, -3:].tolist() == [64, 0, 0]
    assert enc.dense[1, -3:].tolist() == [0, 0, 0] and enc.sparse_bytes.tolist() == [64, 0, 64]


@pytest.mark.parametrize("config", [OakenConfig(), OakenConfig(group_shift=False, scales="window")], ids=_id)
def test_constant_and_zero_vectors(config):
    x = torch.zeros(3, 64)
    x[1] = 1.25  # middle group, a float16 number
    x[2] = 3.5  # outer group
    enc = roundtrip(x, DEFAULT_BOUNDS, config)
    check_error_bounds(x, DEFAULT_BOUNDS, config, enc)
    assert bool((enc.meant[0] == 0).all())
    assert bool((enc.meant[2] == 3.5).all())
    if not config.group_shift:
        assert bool((enc.meant[1] == 1.25).all())
    if config.scales == "token":
        assert bool((record_params(enc.dense, 64, config)[0] == 0).all())  # all zero: (0, 0) everywhere
        assert record_params(enc.dense, 64, config)[2, 0].tolist() == [1.5, 0.0]  # constant: step 0


def test_single_token_and_no_tokens():
    config = OakenConfig(ratios=(0.02, 0.03, 0.9, 0.05))
    x, b = sample(config, 192, 1, tokens=1)
    roundtrip(x, b, config)
    enc = roundtrip(torch.empty(0, 192), b, config)
    assert enc.dense.shape == (0, dense_bytes(192, config)) and enc.sparse.numel() == 0 and enc.meant.shape == (0, 192)
    window = OakenConfig(scales="window")
    roundtrip(torch.empty(0, 64), DEFAULT_BOUNDS, window)


def test_other_float_dtypes_encode_like_float32():
    config = OakenConfig()
    x = kv(4, 64, 9)
    enc = encode_tokens(x.double(), DEFAULT_BOUNDS, config)
    assert torch.equal(enc.meant, encode_tokens(x, DEFAULT_BOUNDS, config).meant)
    half = encode_tokens(x.half(), DEFAULT_BOUNDS.double(), config)
    assert torch.equal(half.meant, encode_tokens(x.half().float(), DEFAULT_BOUNDS, config).meant)


def test_non_finite_input_is_rejected():
    x = kv(6, 64, 2)
    x[3, 5] = float("nan")
    x[5, 0] = float("inf")
    with pytest.raises(KvstrataError, match=r"2 NaN/inf value\(s\) in token\(s\) 3, 5"):
        encode_tokens(x, DEFAULT_BOUNDS, OakenConfig())


def test_values_beyond_float16_are_rejected():
    x = torch.ones(2, 64)
    x[1, 7] = 1e7  # its outer-group step would overflow float16
    with pytest.raises(KvstrataError, match="token 1, group 0"):
        encode_tokens(x, DEFAULT_BOUNDS, OakenConfig())
    x[1, 7] = 1e5
    with pytest.raises(KvstrataError, match="token 1"):
        encode_tokens(x, DEFAULT_BOUNDS, OakenConfig(outliers="fp16"))
    x = torch.ones(2, 64)
    x[0, 1] = -7e4  # dense group of a 2-group config whose min rounds below -65504
    with pytest.raises(KvstrataError, match="float16"):
        encode_tokens(x, torch.tensor([[-1e5, 1e5]]), OakenConfig(ratios=(0.2, 0.8), group_shift=False))


@pytest.mark.parametrize(
    "bounds, message",
    [
        (torch.tensor([[-2.0, 2.0]]), r"shape \[1, 2\]; 3 groups need shape \[2, 2\]"),
        (torch.tensor([[-2.0, 2.0], [-0.5, 0.5], [-0.1, 0.1]]), "shape"),
        (torch.tensor([-2.0, 2.0, -0.5, 0.5]), "shape"),
        (torch.tensor([[-0.5, 2.0], [-2.0, 0.5]]), "not strictly ordered"),
        (torch.tensor([[-2.0, 2.0], [0.5, -0.5]]), "not strictly ordered"),
        (torch.tensor([[-2.0, 2.0], [-2.0, 0.5]]), "not strictly ordered"),
        (torch.tensor([[-2.0, 0.5], [-0.5, 0.5]]), "not strictly ordered"),
        (torch.tensor([[-2.0, 2.0], [float("nan"), 0.5]]), "finite"),
        (torch.tensor([[-2, 2], [-1, 1]]), "float tensor"),
        ([[-2.0, 2.0], [-0.5, 0.5]], "float tensor"),
    ],
)
def test_bad_bounds_are_rejected(bounds, message):
    x = kv(2, 64, 0)
    with pytest.raises(KvstrataError, match=message):
        encode_tokens(x, bounds, OakenConfig())
    enc = encode_tokens(x, DEFAULT_BOUNDS, OakenConfig())
    with pytest.raises(KvstrataError, match=message):
        decode_tokens(enc.dense, enc.sparse, bounds, OakenConfig(), 64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ratios": (1.0,)}, r"2 to 5 group ratios, got 1: \(1.0,\)"),
        ({"ratios": (0.1,) * 6 + (0.4,)}, "2 to 5 group ratios, got 7"),
        ({"ratios": (0.5, 0.6)}, r"sum to 1.1"),
        ({"ratios": (1.2, -0.2)}, r"ratio -0.2 is not allowed"),
        ({"ratios": (1.0, 0.0)}, r"ratio 0.0 is not allowed"),
        ({"ratios": (float("nan"), 0.5)}, r"ratio nan is not allowed"),
        ({"ratios": ("a", "b")}, r"ratio 'a' is not allowed"),
        ({"ratios": "0.5,0.5"}, r"sequence of 2 to 5 fractions, got '0.5,0.5'"),
        ({"group_shift": "yes"}, r"group_shift must be true or false, got 'yes'"),
        ({"outliers": "int4"}, r"outliers 'int4' is not supported; allowed: 5bit, fp16"),
        ({"scales": "head"}, r"scales 'head' is not supported; allowed: token, window"),
    ],
)
def test_bad_config_values_are_rejected(kwargs, message):
    with pytest.raises(KvstrataError, match=message):
        OakenConfig(**kwargs)


def test_config_roles_and_json():
    config = OakenConfig()
    assert config.num_groups == 3 and config.dense_group == 1 and config.sparse_groups == (0, 2)
    assert config.boundary_fractions == pytest.approx((0.04, 0.94))
    assert OakenConfig(ratios=(0.4, 0.4, 0.2)).dense_group == 0
    assert OakenConfig(ratios=(0.1, 0.2, 0.7)).dense_group == 2
    assert OakenConfig(ratios=[0.5, 0.5]).ratios == (0.5, 0.5)
    odd = OakenConfig(ratios=(0.1, 0.2, 0.6, 0.1), group_shift=False, outliers="fp16", scales="window")
    assert OakenConfig.from_json(odd.to_json()) == odd
    assert OakenConfig.from_json(json.dumps(odd.to_json())) == odd
    with pytest.raises(KvstrataError, match="keys"):
        OakenConfig.from_json({**odd.to_json(), "bits": 4})
    with pytest.raises(KvstrataError, match="not valid JSON"):
        OakenConfig.from_json("{ratios")


def test_bounds_are_read_by_value_on_every_call():
    config = OakenConfig()
    x = kv(4, 64, 6)
    b = DEFAULT_BOUNDS.clone()
    first = encode_tokens(x, b, config)
    b[1] *= 0.5  # the same tensor, edited in place: nothing cached may hide the change
    second = roundtrip(x, b, config)
    assert not torch.equal(first.meant, second.meant)
    assert not torch.equal(decode_tokens(first.dense, first.sparse, b, config, 64), first.meant)
    assert torch.equal(decode_tokens(first.dense, first.sparse, DEFAULT_BOUNDS, config, 64), first.meant)


def test_membership_on_the_thresholds():
    x = torch.tensor([-3.0, -2.0, -1.0, -0.5, -0.1, 0.0, 0.1, 0.5, 1.0, 2.0, 3.0])
    assert assign_groups(x, DEFAULT_BOUNDS).tolist() == [0, 0, 1, 1, 2, 2, 2, 1, 1, 0, 0]


def test_widths_and_records_are_checked():
    config = OakenConfig()
    with pytest.raises(KvstrataError, match="width 100"):
        encode_tokens(torch.zeros(2, 100), DEFAULT_BOUNDS, config)
    with pytest.raises(KvstrataError, match="width 0"):
        dense_bytes(0, config)
    with pytest.raises(KvstrataError, match=r"float tensor \[tokens, width\]"):
        encode_tokens(torch.zeros(64), DEFAULT_BOUNDS, config)
    enc = encode_tokens(kv(3, 64, 1), DEFAULT_BOUNDS, config)
    with pytest.raises(KvstrataError, match="outliers"):
        decode_tokens(enc.dense, enc.sparse[:-1], DEFAULT_BOUNDS, config, 64)
    with pytest.raises(KvstrataError, match=r"uint8 \[tokens, 78\]"):
        decode_tokens(enc.dense, enc.sparse, DEFAULT_BOUNDS, config, 128)


def test_encoding_uses_no_sort_or_topk(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the online Oaken encoder must not sort")

    x, b = sample(OakenConfig(), 192, 0)
    for name in ("sort", "argsort", "topk", "kthvalue", "msort", "quantile", "median"):
        monkeypatch.setattr(torch, name, forbidden)
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    enc = encode_tokens(x, b, OakenConfig())
    assert torch.equal(decode_tokens(enc.dense, enc.sparse, b, OakenConfig(), 192), enc.meant)


TOKEN_CONFIGS = [c for c in CONFIGS if c.scales == "token"]


@pytest.mark.skipif(paged_decode.kernel() is None, reason="no C++ compiler: the compiled encoder could not be built")
@pytest.mark.parametrize("config", TOKEN_CONFIGS, ids=_id)
@pytest.mark.parametrize("width", WIDTHS)
def test_compiled_encoder_writes_the_same_bytes(config, width):
    """The compiled encoder (kv/kernels/oaken_encode.cpp) writes exactly encode_tokens' bytes, values on thresholds,
    constant tokens, tokens on one side of zero, tiny values (float16 subnormal parameters) and zeros of both signs
    (a range that ends at zero takes the sign of the first zero) included."""
    seeds = range(3)
    for seed in seeds:
        x, b = sample(config, width, seed, tokens=40)
        x[1] = 0.75  # one constant value: a zero step
        x[2] = x[2].abs() + 0.01  # every value on the high side
        x[3] *= 1e-6  # parameters among float16's subnormals
        x[4, ::2], x[4, 1::2] = -0.0, 0.0  # zeros alone, -0.0 first
        x[5, ::3], x[5, 1::3], x[5, 2::3] = 0.0, -0.0, 0.0  # +0.0 first
        x[6] = x[6].abs()  # a range from zero up, with -0.0 met before +0.0
        x[6, 9], x[6, 20], x[6, 40] = -0.0, 0.0, -0.0
        x[7] = -x[7].abs()  # a range up to zero, with +0.0 met before -0.0
        x[7, 3], x[7, 33] = 0.0, -0.0
        got = codec.encode_tokens_compiled(x, b, config)
        want = encode_tokens(x, b, config)
        assert got is not None
        assert torch.equal(got[0], want.dense)
        assert torch.equal(got[1], want.sparse)
        assert torch.equal(got[2], want.sparse_bytes.long())


@pytest.mark.skipif(paged_decode.kernel() is None, reason="no C++ compiler: the compiled encoder could not be built")
def test_compiled_encoder_leaves_out_of_range_values_to_the_clear_error():
    config = OakenConfig(outliers="fp16")
    x = torch.full((2, 64), 1e6)  # outliers kept as float16 cannot hold it
    assert codec.encode_tokens_compiled(x, DEFAULT_BOUNDS, config) is None
    with pytest.raises(KvstrataError, match="outside"):
        encode_tokens(x, DEFAULT_BOUNDS, config)
    assert codec.encode_tokens_compiled(x[:, :64] * 0, DEFAULT_BOUNDS, config) is not None
    assert codec.encode_tokens_compiled(x * 0, DEFAULT_BOUNDS, OakenConfig(scales="window")) is None  # not its job


@pytest.mark.skipif(paged_decode.kernel() is None, reason="no C++ compiler: the compiled encoder could not be built")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("config", [OakenConfig(), OakenConfig(outliers="fp16")], ids=_id)
def test_compiled_encoder_leaves_values_that_are_not_finite_to_the_clear_error(bad, config):
    x, b = sample(config, 128, 0)
    x[2, 70] = bad
    dense, _, _ = paged_decode.kernel().oaken_encode(x, *codec.encoder_tables(b, config, x.device))
    assert dense.numel() == 0
    with pytest.raises(KvstrataError, match="NaN/inf"):
        encode_tokens(x, b, config)
