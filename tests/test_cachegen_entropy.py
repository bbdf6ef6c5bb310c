"""CacheGen's entropy stage: the compiled rANS coder is lossless on every model shape the codec makes, refuses a
corrupt stream, and streams coded by constriction (before it, or where it cannot be built) still decode."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.cachegen import codec, entropy
from kvstrata.cachegen.entropy import COMPILED_SECTION, CONSTRICTION_SECTION, SymbolModel, counted_model
from kvstrata.cachegen.errors import CorruptStreamError
from kvstrata.cachegen.levels import ALL_LEVELS
from tests.test_cachegen_codec import kv_tensor

pytestmark = pytest.mark.skipif(entropy.compiled_coder() is None, reason="the compiled rANS coder did not build")


def groups_and_models(seed: int = 0):
    """Groups as the codec makes them, and a few it must survive: empty, one repeated symbol, a 2^20-wide range, a
    profiled-style model that gives symbols the group never uses a small probability."""
    rng = np.random.default_rng(seed)
    groups = [np.round(rng.laplace(rng.normal(0, 3), scale, size=int(rng.integers(1, 300)))).astype(np.int32)
              for scale in rng.uniform(0.2, 10, size=200)]
    groups += [np.zeros(0, np.int32), np.full(17, -5, np.int32), np.array([-(1 << 19), 0, (1 << 19) - 1], np.int32)]
    models = [counted_model(g)[0] if g.size else SymbolModel(0, np.ones(1)) for g in groups]
    wide = np.exp(-np.abs(np.arange(-40, 41)) / 3.0)
    groups.append(np.array([-40, 0, 1, 40, 2], np.int32))
    models.append(SymbolModel(-40, wide / wide.sum()))
    return groups, models


def decode(sections, models, groups):
    flat = entropy.decode_symbols(sections, models, [g.size for g in groups])
    return np.split(flat, np.cumsum([g.size for g in groups])[:-1])


def test_compiled_coder_round_trips_every_group():
    groups, models = groups_and_models()
    name, data = entropy.encode_groups(groups, models)
    assert name == COMPILED_SECTION and len(data) % 4 == 0
    assert all(np.array_equal(a, b) for a, b in zip(decode({name: data}, models, groups), groups))


def test_compiled_coder_costs_what_the_model_says():
    """Within a few bytes per group of the ideal -sum(log2 p): the 24-bit frequencies lose almost nothing."""
    groups, models = groups_and_models(seed=1)
    _, data = entropy.encode_groups(groups, models)
    ideal = sum(-np.log2(m.probabilities[g - m.lo]).sum() for g, m in zip(groups, models)) / 8
    assert ideal <= len(data) <= ideal + 16


def test_streams_of_constriction_still_decode():
    groups, models = groups_and_models(seed=2)
    old = entropy._constriction_encode(groups, models)
    assert all(np.array_equal(a, b) for a, b in zip(decode({CONSTRICTION_SECTION: old}, models, groups), groups))


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "odd length", "empty"])
def test_corrupt_compiled_streams_are_refused(damage):
    groups, models = groups_and_models(seed=3)
    _, data = entropy.encode_groups(groups, models)
    broken = {"flip": data[:40] + bytes([data[40] ^ 0x5A]) + data[41:], "truncate": data[:-4],
              "extend": data + b"\x01\x00\x00\x00", "odd length": data[:-1], "empty": b""}[damage]
    with pytest.raises(CorruptStreamError):
        entropy.decode_symbols({COMPILED_SECTION: broken}, models, [g.size for g in groups])


def test_a_stream_without_symbols_is_refused():
    with pytest.raises(CorruptStreamError, match="no coded symbols"):
        entropy.decode_symbols({"scales": b""}, [SymbolModel(0, np.ones(1))], [1])


@pytest.mark.parametrize("level", ["medium", "uniform4-ac"])
def test_without_a_compiler_streams_fall_back_to_constriction(monkeypatch, level):
    """A machine that cannot build the coder writes constriction's streams (which every machine reads) and names
    the missing compiler when it meets a compiled stream."""
    x = kv_tensor()
    compiled = codec.encode_tensor(x, ALL_LEVELS[level], "k")
    assert COMPILED_SECTION in compiled and CONSTRICTION_SECTION not in compiled
    monkeypatch.setattr(entropy, "compiled_coder", lambda: None)
    fallback = codec.encode_tensor(x, ALL_LEVELS[level], "k")
    assert CONSTRICTION_SECTION in fallback and COMPILED_SECTION not in fallback
    with pytest.raises(CorruptStreamError, match="C\\+\\+ compiler is needed"):
        codec.decode_tensor(compiled, ALL_LEVELS[level], tuple(x.shape), "k")
    monkeypatch.undo()
    # either stream decodes to the same tensor
    assert codec.decode_tensor(fallback, ALL_LEVELS[level], tuple(x.shape), "k").equal(
        codec.decode_tensor(compiled, ALL_LEVELS[level], tuple(x.shape), "k"))


def test_models_the_coder_cannot_hold_are_a_corrupt_stream():
    """A corrupt stream's symbol ranges can describe a model wider than 2^23 symbols; the coder's refusal surfaces
    as CorruptStreamError, which readers turn into a recompute."""
    with pytest.raises(CorruptStreamError, match="1 to 2\\^23 symbols"):
        entropy.decode_symbols({COMPILED_SECTION: b"\x00" * 8}, [SymbolModel(0, np.full(1 << 24, 2.0**-24))], [1])
