"""CacheGen KV codec: per-element error bounds, a lossless entropy stage, settings checks, the checked file format."""

from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest
import torch

from kvstrata.cachegen import codec, quantize
from kvstrata.cachegen.bitstream import KVFile, KVFileHeader, ModelShape, Record, write_kv_file
from kvstrata.cachegen.errors import CorruptStreamError, ForeignModelError
from kvstrata.cachegen.levels import ALL_LEVELS, SENSITIVITY_LEVELS, CodecSettings
from kvstrata.cachegen.profile import ProfileBuilder, TensorProfile
from kvstrata.errors import KvstrataError

ABLATIONS = {
    "differences-kv": CodecSettings(differences="kv"),
    "no-differences": CodecSettings(differences="none"),
    "global-models": CodecSettings(models="global"),
    "uniform4-global": CodecSettings(quantizer="uniform", bits=4, models="global"),
    "fitted-models": CodecSettings(source="fitted"),
    "fitted-direct": CodecSettings(differences="none", source="fitted", sink_anchor_only=True),
}
SETTINGS = {**ALL_LEVELS, **ABLATIONS}
PROFILED = CodecSettings(source="profiled")



def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kv_tensor(layers: int = 6, tokens: int = 57, channels: int = 16, seed: int = 0) -> torch.Tensor:
    """Gaussian values shaped like a real K cache: a wide outlier channel, an offset channel and a spike token."""
    x = torch.randn(layers, tokens, channels, generator=generator(seed))
    x[:, :, 1] *= 30
    x[:, :, channels - 3] += 20
    x[:, tokens // 3] *= 8
    return x


def quantized(x: torch.Tensor, settings: CodecSettings, kind: str, profile: TensorProfile | None = None,
              first_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's own reconstruction (what decoding must return exactly) and each element's error bound, for
    a chunk whose first token sits at `first_position`."""
    if settings.quantizer == "uniform":
        symbols = quantize.quantize_uniform(x, settings.bits)
        bound = (symbols.scale.float() / 2)[..., None].expand_as(x)
        return quantize.dequantize_uniform(symbols), bound
    differences = settings.differences_for(kind)
    steps = profile.steps(settings.bins[0]) if settings.allocation == "sensitivity" else None
    symbols = quantize.quantize_cachegen(x, codec.layer_bins(settings.bins, x.shape[0]), differences, steps,
                                         anchored=codec.anchors_first_token(settings, first_position))
    return (quantize.dequantize_cachegen(symbols, x.shape[1], differences),
            quantize.cachegen_error_bound(symbols, x.shape[1], differences))


def assert_round_trip(x: torch.Tensor, settings: CodecSettings, profile: TensorProfile | None = None) -> torch.Tensor:
    """Coded as K and as V: encoding is deterministic, the entropy stage is lossless, and every element
    is within its bound. Returns the tensor decoded as V."""
    for kind in ("k", "v"):
        sections = codec.encode_tensor(x, settings, kind, profile)
        assert codec.encode_tensor(x, settings, kind, profile) == sections
        decoded = codec.decode_tensor(sections, settings, tuple(x.shape), kind, profile)
        expected, bound = quantized(x, settings, kind, profile)
        assert torch.equal(decoded, expected), "the decoded symbols differ from the encoded ones"
        error = (decoded - x).abs()
        excess = error - (bound * (1 + 1e-5) + 1e-6)  # float32 slack
        worst = np.unravel_index(int(excess.argmax()), tuple(x.shape))
        assert excess[worst] <= 0, f"{kind}: error {error[worst]:.3g} exceeds its bound {bound[worst]:.3g} at {worst}"
    return decoded


# --- error bounds ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 10, 23, 57])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_round_trip_within_bound(name, num_tokens):
    assert_round_trip(kv_tensor(tokens=num_tokens), SETTINGS[name])


def sensitivity(layers: int = 6, channels: int = 16, seed: int = 5) -> torch.Tensor:
    """Mean squared gradients spanning six orders of magnitude, like a real model's K and V."""
    return 10 ** (6 * torch.rand(layers, channels, generator=generator(seed)) - 3)


def test_steps_from_sensitivity_follow_its_inverse_square_root():
    """s[l, c] = scale / sqrt(F[l, c]), up to the codes' rounding (1/16 of an octave)."""
    weights = sensitivity()
    steps, codes = quantize.steps_from_sensitivity(weights, 0.3)
    channel_steps = steps[:, None] * quantize.channel_multipliers(codes)
    ratio = channel_steps / (0.3 / weights.sqrt())
    assert ratio.log2().abs().max() <= 1 / (2 * quantize.CHANNEL_CODE_STEPS) + 1e-6


@pytest.mark.parametrize("settings", [SENSITIVITY_LEVELS["medium"], SENSITIVITY_LEVELS["near-lossless"],
                                      dataclasses.replace(SENSITIVITY_LEVELS["low"], models="global"),
                                      dataclasses.replace(SENSITIVITY_LEVELS["medium"], differences="k")])
def test_sensitivity_steps_round_trip_within_bound_and_travel_in_the_stream(settings):
    x = kv_tensor()
    profile = build_profile([kv_tensor(seed=1)])
    sections = codec.encode_tensor(x, settings, "k", profile)
    assert "channels" in sections and "channels" not in codec.encode_tensor(x, ALL_LEVELS["medium"], "k")
    # Models counted per chunk: the decoder reads the steps from the stream and needs no profile.
    assert torch.equal(codec.decode_tensor(sections, settings, tuple(x.shape), "k"),
                       quantized(x, settings, "k", profile)[0])
    assert_round_trip(x, settings, profile)
    with pytest.raises(ValueError, match="profile"):
        codec.encode_tensor(x, settings, "k")


def test_steps_from_sensitivity_lower_the_weighted_error_at_fewer_bytes():
    """The loss an error causes, sum F (x_hat - x)^2, is smaller with steps from the sensitivity than with one
    step per layer, even at a coarser level and fewer bytes."""
    layers, tokens, channels = 4, 400, 32
    x = torch.randn(layers, tokens, channels, generator=generator(7)) * torch.linspace(0.2, 5, channels)
    weights = sensitivity(layers, channels, seed=8)
    profile = build_profile([x], weights)

    def weighted_error_and_size(settings):
        sections = codec.encode_tensor(x, settings, "v", profile)
        x_hat = codec.decode_tensor(sections, settings, tuple(x.shape), "v")
        return (weights[:, None] * (x_hat - x).square()).mean().item(), sum(len(b) for b in sections.values())

    plain_error, plain_size = weighted_error_and_size(ALL_LEVELS["high"])
    weighted_error, weighted_size = weighted_error_and_size(SENSITIVITY_LEVELS["low"])
    assert weighted_size < plain_size
    assert weighted_error < 0.5 * plain_error


@pytest.mark.parametrize("value", [0.0, -2.75, 1000.0])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_constant_tensor_round_trip(name, value):
    x = torch.full((6, 23, 16), value)
    decoded = assert_round_trip(x, SETTINGS[name])
    if value == 0:
        assert torch.equal(decoded, x)


# Scales below float16's smallest normal number (6.1e-5) must neither clip values nor round to zero.

@pytest.mark.parametrize(
    "level, magnitude",
    [
        ("medium", 1e-3),
        ("uniform8", 1e-3),
        ("medium", 1e-4),
        ("uniform8", 1e-4),
        ("medium", 1e-6),
        ("uniform8", 1e-9),
    ],
)
def test_small_values_round_trip(level, magnitude):
    assert_round_trip(torch.randn(6, 57, 16, generator=generator(3)) * magnitude, ALL_LEVELS[level])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["medium", "uniform4"])
def test_non_finite_input_is_refused(name, bad):
    x = kv_tensor()
    x[2, 40, 7] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        codec.encode_tensor(x, ALL_LEVELS[name], "k")


# --- raw bit packing ------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 7, 8, 13, 64])
@pytest.mark.parametrize("bits", range(2, 9))
def test_pack_bits_round_trip(bits, count):
    values = torch.randint(0, 2**bits, (count,), generator=generator(bits * 100 + count))
    data = codec.pack_bits(values, bits)
    assert len(data) == -(-count * bits // 8)
    assert np.array_equal(codec.unpack_bits(data, bits, count), values.numpy())


@pytest.mark.parametrize("bits", range(2, 9))
def test_unpack_bits_refuses_wrong_length(bits):
    data = codec.pack_bits(torch.arange(13) % 2**bits, bits)
    for wrong in (data[:-1], data + b"\x00"):
        with pytest.raises(CorruptStreamError, match="packed symbols"):
            codec.unpack_bits(wrong, bits, 13)


# --- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"bins": (0.5, -1.0, 1.5)}, ["-1.0"]),
        ({"bins": (0.5, 1.0)}, ["(0.5, 1.0)"]),
        ({"bits": 9}, ["9"]),
        ({"quantizer": "uniform", "bits": 1}, ["1"]),
        ({"quantizer": "lossy"}, ["lossy"]),
        ({"models": "raw"}, ["raw"]),
        ({"source": "profiled", "models": "global"}, ["profiled", "global"]),
        ({"source": "fitted", "quantizer": "uniform"}, ["fitted", "uniform"]),
        ({"sink_anchor_only": 1}, ["sink_anchor_only", "1"]),
        ({"sink_anchor_only": True, "differences": "kv"}, ["sink_anchor_only", "kv"]),
        ({"sink_anchor_only": True, "quantizer": "uniform"}, ["sink_anchor_only", "uniform"]),
    ],
    ids=["negative-bin", "two-bins", "bits-9", "bits-1", "quantizer", "raw-cachegen", "profiled-global",
         "fitted-uniform", "sink-anchor-not-bool", "sink-anchor-all-differences", "sink-anchor-uniform"],
)
def test_invalid_settings_name_the_value(kwargs, words):
    with pytest.raises(KvstrataError) as err:
        CodecSettings(**kwargs)
    for word in words:
        assert word in str(err.value)


# --- profiled models ------------------------------------------------------------------------


def build_profile(tensors, weights: torch.Tensor | None = None) -> TensorProfile:
    builder = ProfileBuilder()
    for x in tensors:
        builder.add(x)
    layers, _, channels = x.shape
    return builder.build((weights if weights is not None else sensitivity(layers, channels)).numpy())


@pytest.mark.parametrize("outlier_factor", [1.0, 100.0])
def test_profiled_models_round_trip(outlier_factor):
    profile = build_profile(kv_tensor(seed=seed) for seed in (1, 2, 3))
    x = kv_tensor(seed=4)
    x[:, :, 5] *= outlier_factor  # symbols far outside anything the profile saw must stay codable
    assert_round_trip(x, PROFILED, profile)
    assert_round_trip(x, dataclasses.replace(SENSITIVITY_LEVELS["medium"], source="profiled"), profile)


# --- the saved-context file -----------------------------------------------------------------

SHAPE = ModelShape("abcd1234abcd1234", 3, 2, 4)
CHUNKS = [(0, 13), (13, 23)]
FILE_SETTINGS = {"medium": ALL_LEVELS["medium"], "uniform4": ALL_LEVELS["uniform4"], "profiled": PROFILED,
                 "fitted": ABLATIONS["fitted-direct"]}


def context_tensors() -> dict[str, torch.Tensor]:
    channels = SHAPE.num_kv_heads * SHAPE.head_dim
    return {kind: kv_tensor(SHAPE.num_layers, CHUNKS[-1][1], channels, seed) for kind, seed in (("k", 10), ("v", 11))}


def context_profiles() -> dict[str, TensorProfile]:
    return {kind: build_profile([x]) for kind, x in context_tensors().items()}


def context_file(profiles: dict[str, TensorProfile]) -> tuple[KVFileHeader, list[dict[str, bytes]]]:
    """Two chunks, each at three levels; payload sections named "k.scales", ..., "v.symbols"."""
    tensors = context_tensors()
    records, payloads = [], []
    for chunk, (start, end) in enumerate(CHUNKS):
        for level, settings in FILE_SETTINGS.items():
            records.append(Record(chunk, level, settings, 0, {}, ""))
            payloads.append({
                f"{kind}.{name}": data
                for kind, x in tensors.items()
                for name, data in codec.encode_tensor(x[:, start:end], settings, kind, profiles[kind],
                                                      first_position=start).items()
            })
    token_ids = list(range(1000, 1000 + CHUNKS[-1][1]))
    return KVFileHeader(SHAPE, token_ids, list(CHUNKS), "profile-digest", records), payloads


def decode_file(data: bytes, profiles: dict[str, TensorProfile]) -> tuple:
    """Everything a reader gets out of a file: token ids, chunk bounds and every record's K and V tensors."""
    kv = KVFile(data)
    model = kv.header.model
    tensors = {}
    for record in kv.header.records:
        sections = kv.sections(record)
        start, end = kv.header.chunk_bounds[record.chunk]
        shape = (model.num_layers, end - start, model.num_kv_heads * model.head_dim)
        for kind in ("k", "v"):
            mine = {name.removeprefix(f"{kind}."): b for name, b in sections.items() if name.startswith(f"{kind}.")}
            tensors[record.chunk, record.level, kind] = codec.decode_tensor(mine, record.settings, shape, kind,
                                                                            profiles[kind], first_position=start)
    return kv.header.token_ids, kv.header.chunk_bounds, tensors


def same_decode(a: tuple, b: tuple) -> bool:
    (tokens_a, bounds_a, tensors_a), (tokens_b, bounds_b, tensors_b) = a, b
    return (tokens_a, bounds_a) == (tokens_b, bounds_b) and tensors_a.keys() == tensors_b.keys() and all(
        torch.equal(tensors_a[key], tensors_b[key]) for key in tensors_a
    )


@pytest.fixture(scope="module")
def saved_context(tmp_path_factory):
    """(path, payloads, profiles) of a small valid file, about 4 KB."""
    profiles = context_profiles()
    header, payloads = context_file(profiles)
    path = tmp_path_factory.mktemp("context") / "ctx.kv"
    assert write_kv_file(path, header, payloads) == path.stat().st_size
    return path, payloads, profiles


def test_kv_file_round_trip(saved_context):
    path, payloads, profiles = saved_context
    kv = KVFile.open(path)
    kv.check_model(ModelShape(**vars(SHAPE)))
    assert kv.header.token_ids == list(range(1000, 1023))
    assert kv.header.chunk_bounds == CHUNKS
    assert [(r.chunk, r.level, r.settings) for r in kv.header.records] == [
        (chunk, level, settings) for chunk in range(len(CHUNKS)) for level, settings in FILE_SETTINGS.items()
    ]
    for record, written in zip(kv.header.records, payloads, strict=True):
        assert kv.sections(record) == written
    originals = context_tensors()
    _, _, tensors = decode_file(path.read_bytes(), profiles)
    for (chunk, level, kind), decoded in tensors.items():
        start, end = CHUNKS[chunk]
        assert torch.equal(decoded, quantized(originals[kind][:, start:end], FILE_SETTINGS[level], kind,
                                              first_position=start)[0])


def test_kv_file_refuses_other_models(saved_context):
    kv = KVFile.open(saved_context[0])
    with pytest.raises(ForeignModelError, match="ffff0000ffff0000"):
        kv.check_model(ModelShape("ffff0000ffff0000", SHAPE.num_layers, SHAPE.num_kv_heads, SHAPE.head_dim))
    with pytest.raises(CorruptStreamError, match="model shape"):
        kv.check_model(ModelShape(SHAPE.fingerprint, SHAPE.num_layers, SHAPE.num_kv_heads, 2 * SHAPE.head_dim))


def mutate(data: bytes, rng: random.Random, lo: int, hi: int) -> tuple[bytes, str]:
    """One random edit at a position in [lo, hi), and a description of it."""
    out = bytearray(data)
    kind = rng.choice(("flip", "overwrite", "truncate", "insert", "delete"))
    position = rng.randrange(lo, hi + (kind == "insert"))  # an insert may also go right after the region
    if kind == "flip":
        out[position] ^= 1 << rng.randrange(8)
    elif kind == "overwrite":
        out[position] = rng.randrange(256)
    elif kind == "truncate":
        del out[position:]
    elif kind == "insert":
        out[position:position] = rng.randbytes(rng.randint(1, 8))
    else:
        del out[position : position + rng.randint(1, 8)]
    return bytes(out), f"{kind} at {position}"


def test_kv_file_fuzz(saved_context):
    """Every mutant is refused with a KvstrataError or decodes exactly like the original, never anything else."""
    path, _, profiles = saved_context
    data = path.read_bytes()
    original = decode_file(data, profiles)
    payload_start = KVFile(data).payload_start
    regions = {"anywhere": (0, len(data)), "header": (0, payload_start), "payload": (payload_start, len(data))}
    rng = random.Random(1234)
    outcomes, failures = {"refused": 0, "identical": 0}, []
    for index in range(3000):
        region = list(regions)[index % len(regions)]
        mutant, edits = data, []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            lo, hi = regions[region][0], min(regions[region][1], len(mutant))
            if hi <= lo:  # an earlier edit truncated the region away
                break
            mutant, edit = mutate(mutant, rng, lo, hi)
            edits.append(edit)
        try:
            result = decode_file(mutant, profiles)
        except KvstrataError:
            outcomes["refused"] += 1
            continue
        except Exception as exc:  # noqa: BLE001 - any other exception type is what this test looks for
            failures.append(f"{region} {edits}: {type(exc).__name__}: {exc}")
            continue
        if same_decode(result, original):
            outcomes["identical"] += 1
        else:
            failures.append(f"{region} {edits}: decoded silently into different data")
    assert not failures, f"{len(failures)} bad mutants, e.g. {failures[:5]}"
    assert outcomes["refused"] > 2700, outcomes  # the mutator really damages files


# --- atomic writes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "missing/ctx.kv",
        "plain/ctx.kv",
        "folder",
        "readonly/ctx.kv",
    ],
)
def test_failed_write_raises_and_leaves_nothing(tmp_path, target):
    (tmp_path / "plain").write_bytes(b"")  # a file where a directory is expected
    (tmp_path / "folder").mkdir()  # a directory where the file should go
    (tmp_path / "readonly").mkdir(mode=0o500)
    if target.startswith("readonly") and os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    before = sorted(tmp_path.rglob("*"))
    header, payloads = context_file(context_profiles())
    with pytest.raises(KvstrataError, match="could not write the KV file"):
        write_kv_file(tmp_path / target, header, payloads)
    assert sorted(tmp_path.rglob("*")) == before


def test_open_missing_file_raises(tmp_path):
    with pytest.raises(KvstrataError, match="cannot read the KV file"):
        KVFile.open(str(tmp_path / "absent.kv"))
