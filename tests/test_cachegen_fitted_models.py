"""Coder models fitted per chunk (kvstrata/cachegen/fitted_models.py) and the anchor only a context's first chunk
keeps: lossless, near the groups' own entropy where one shared model is not, and a bad parameter block refused."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvstrata.cachegen import codec, entropy, quantize
from kvstrata.cachegen.errors import CorruptStreamError
from kvstrata.cachegen.fitted_models import FittedModels, gaussian_table
from kvstrata.cachegen.levels import CodecSettings

FITTED = CodecSettings(differences="none", source="fitted", sink_anchor_only=True)


def spread_groups(seed: int = 0) -> list[np.ndarray]:
    """Rounded Gaussians whose spreads span three orders of magnitude, with offset means, one empty group and one
    constant group, as a transform's components are."""
    rng = np.random.default_rng(seed)
    groups = [np.round(rng.normal(rng.uniform(-3, 3), 10 ** rng.uniform(-1, 2), size=255)).astype(np.int32)
              for _ in range(40)]
    return [*groups, np.zeros(0, dtype=np.int32), np.full(255, 7, dtype=np.int32)]


def coded_bytes(groups: list[np.ndarray], models: list[entropy.SymbolModel]) -> int:
    return len(entropy.encode_groups(groups, models)[1])


def own_entropy_bytes(groups: list[np.ndarray]) -> float:
    """What a model per group that knew its exact histogram would need, tables free."""
    bits = 0.0
    for group in groups:
        if group.size:
            counts = np.bincount(group - group.min())
            p = counts[counts > 0] / group.size
            bits -= float((counts[counts > 0] * np.log2(p)).sum())
    return bits / 8


@pytest.mark.parametrize("coder", ["compiled", "constriction"])
def test_fitted_models_decode_to_the_groups_and_cost_near_their_own_entropy(coder, monkeypatch):
    if coder == "constriction":
        monkeypatch.setattr(entropy, "compiled_coder", lambda: None)
    elif entropy.compiled_coder() is None:
        pytest.skip("the compiled coder could not be built here")
    groups = spread_groups()
    fitted = FittedModels.fit(groups)
    models, group_models = fitted.coder_models
    assert len(models) < len(groups) and len(group_models) == len(groups)  # groups sharing codes share a model
    section, data = entropy.encode_groups([g - o for g, o in zip(groups, fitted.offsets())], models, group_models)
    sizes = [g.size for g in groups]
    parsed = FittedModels.from_bytes(fitted.to_bytes(), len(groups))
    flat = entropy.decode_symbols({section: data}, parsed.coder_models.models, sizes,
                                  parsed.coder_models.group_models, parsed.offsets())
    assert flat.dtype == np.int32 and np.array_equal(flat, np.concatenate(groups))
    fitted_size = len(data) + len(fitted.to_bytes())
    one_model = coded_bytes([np.concatenate(groups)], [entropy.counted_model(np.concatenate(groups))[0]])
    assert fitted_size < 0.8 * one_model
    assert fitted_size < 1.1 * own_entropy_bytes(groups) + 64


def test_the_compiled_coder_refuses_a_group_naming_no_model_or_offsets_that_overflow():
    coder = entropy.compiled_coder()
    if coder is None:
        pytest.skip("the compiled coder could not be built here")
    model = entropy.SymbolModel(0, np.array([0.5, 0.5]))
    _, data = entropy.encode_groups([np.array([0, 1, 1], dtype=np.int32)], [model])
    words = torch.from_numpy(np.frombuffer(data, dtype=np.int32).copy())
    sizes, lengths, probabilities = torch.tensor([3]), torch.tensor([2]), torch.tensor([0.5, 0.5], dtype=torch.float64)
    offsets = torch.zeros(1, dtype=torch.int32)
    assert coder.rans_decode(words, sizes, torch.tensor([0]), lengths, probabilities, offsets).tolist() == [0, 1, 1]
    for bad_model in (1, -1):
        with pytest.raises(RuntimeError, match="names a model"):
            coder.rans_decode(words, sizes, torch.tensor([bad_model]), lengths, probabilities, offsets)
    with pytest.raises(ValueError, match="beyond 32-bit"):
        coder.rans_decode(words, sizes, torch.tensor([0]), lengths, probabilities,
                          torch.tensor([2**31 - 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="group offsets"):
        coder.rans_decode(words, sizes, torch.tensor([0]), lengths, probabilities, torch.zeros(2, dtype=torch.int32))


def test_gaussian_tables_are_centred_on_the_mean_s_fraction_and_read_only():
    centred, quarter = gaussian_table(0, 0, 8), gaussian_table(0, 1, 8)
    assert centred.sum() == pytest.approx(1) and int(np.argmax(centred)) == 8
    assert np.allclose(centred, centred[::-1])
    assert quarter[9] > centred[9] and quarter[7] < centred[7]
    with pytest.raises(ValueError):
        centred[0] = 1.0


def parameters(spreads: list[int], reach_bits: list[int]) -> bytes:
    rows = np.zeros(len(spreads), dtype=[("mean", "<i4"), ("spread", "i1")])
    rows["spread"] = spreads
    return zlib.compress(rows.tobytes() + np.array(reach_bits, dtype=np.uint8).tobytes())


WIDE_SPREADS = list(range(-16, 64, 2))  # 40 groups, 40 models


@pytest.mark.parametrize("data, num_groups, words", [
    (b"not deflated", 3, "inflate"),
    (parameters([0, 0], []), 3, "too few"),
    (parameters([0, 0, 1], [4]), 3, "1 reaches for 2 models"),
    (parameters([0, 0, 0], [17]), 3, "2\\^17 symbols"),
    (parameters(WIDE_SPREADS, [16] * len(WIDE_SPREADS)), len(WIDE_SPREADS), "entries"),  # 40 tables of 2^17 + 1
    (parameters([0, 90, 0], [3, 3]), 3, "spread code"),
])
def test_a_bad_parameter_block_is_refused(data, num_groups, words):
    with pytest.raises(CorruptStreamError, match=words):
        FittedModels.from_bytes(data, num_groups)


def chunk(tokens: int = 40, channels: int = 12, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 1.5, channels)
    return torch.randn(2, tokens, channels, generator=generator) * scales + 3


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("tokens", [1, 40, 256])
def test_only_a_context_s_first_chunk_keeps_its_first_token_as_an_anchor(kind, tokens):
    x = chunk(tokens)
    layers, _, channels = x.shape
    for position, anchored in ((0, True), (256, False)):
        sections = codec.encode_tensor(x, FITTED, kind, first_position=position)
        assert len(sections["scales"]) == 4 * layers + (2 * layers * channels if anchored else 0)
        decoded = codec.decode_tensor(sections, FITTED, tuple(x.shape), kind, first_position=position)
        symbols = quantize.quantize_cachegen(x, codec.layer_bins(FITTED.bins, layers), False, anchored=anchored)
        assert torch.equal(decoded, quantize.dequantize_cachegen(symbols, tokens, False))
        bound = quantize.cachegen_error_bound(symbols, tokens, False)
        assert ((decoded - x).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    # an unanchored chunk's first token is coded like the rest, at its step
    step = float(symbols.step[0])
    assert (decoded[0, 0] - x[0, 0]).abs().max() <= step / 2 * (1 + 1e-5)
    with pytest.raises(CorruptStreamError, match="section holds"):
        codec.decode_tensor(sections, FITTED, tuple(x.shape), kind, first_position=0)


def test_settings_written_before_the_sink_anchor_option_read_as_anchored():
    old = {k: v for k, v in CodecSettings().to_json().items() if k != "sink_anchor_only"}
    assert CodecSettings.from_json(old).sink_anchor_only is False
