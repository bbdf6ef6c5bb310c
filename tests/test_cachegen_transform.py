"""Transform coding (kvstrata/cachegen/transform.py): each KV head's channels decorrelated before quantization."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.cachegen import codec, quantize
from kvstrata.cachegen.errors import CorruptStreamError
from kvstrata.cachegen.levels import IMPORTANCE_LEVELS, TRANSFORM_LEVELS, CodecSettings, settings_for
from kvstrata.cachegen.profile import CodecProfile, TensorProfile, shipped_profile
from kvstrata.cachegen.transform import rope_angles
from kvstrata.errors import KvstrataError
from kvstrata.model.rotary import apply_rope
from tests.transform_cases import DIM, FREQUENCIES, HEADS, LAYERS, codec_profile, correlated, profile_of

MEDIUM = TRANSFORM_LEVELS["medium"]


@pytest.mark.parametrize("kind", ["k", "v"])
def test_the_transform_inverts_and_decorrelates_the_calibration_text(kind):
    transform = profile_of(kind).transform
    rotation = torch.from_numpy(transform.rotation).double()
    assert torch.allclose(rotation.transpose(-1, -2) @ rotation, torch.eye(DIM, dtype=torch.double), atol=1e-5)
    x = correlated(300, seed=0, rotary=kind == "k")
    z = transform.forward(x[:, 1:], first_position=1)
    assert torch.allclose(transform.inverse(z, first_position=1), x[:, 1:], atol=1e-4)
    heads = z.double().reshape(LAYERS, -1, HEADS, DIM)
    covariance = torch.einsum("lthd,lthe->lhde", heads, heads) / heads.shape[1]
    off_diagonal = covariance - torch.diag_embed(torch.diagonal(covariance, dim1=-2, dim2=-1))
    assert off_diagonal.abs().max() < 0.1 * covariance.abs().max()
    variances = torch.diagonal(covariance, dim1=-2, dim2=-1).sort(dim=-1).values
    assert (variances[..., -3] < 0.01 * variances[..., -1]).all()  # two strong components per head, the rest small


def test_keys_are_coded_as_they_were_before_rope():
    """A key's components depend on its vector before RoPE, not on where it sits: the transform undoes RoPE at the
    positions it is told."""
    transform = profile_of("k").transform
    before = correlated(40, seed=7, rotary=False).reshape(LAYERS, 40, HEADS, DIM).double()
    at_0 = apply_rope(before, *rope_angles(FREQUENCIES, 0, 40)).float().reshape(LAYERS, 40, -1)
    at_500 = apply_rope(before, *rope_angles(FREQUENCIES, 500, 40)).float().reshape(LAYERS, 40, -1)
    assert not torch.allclose(at_0, at_500, atol=1e-2)
    assert torch.allclose(transform.forward(at_0, 0), transform.forward(at_500, 500), atol=1e-4)
    assert not torch.allclose(transform.forward(at_0, 0), transform.forward(at_500, 0), atol=1e-2)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_transform_coding_round_trips_within_the_components_bound(kind):
    profile = profile_of(kind)
    x = correlated(90, seed=11, rotary=kind == "k")
    settings = dataclasses.replace(MEDIUM, token_steps=False)
    sections = codec.encode_tensor(x, settings, kind, profile, first_position=30)
    assert codec.encode_tensor(x, settings, kind, profile, first_position=30) == sections
    decoded = codec.decode_tensor(sections, settings, tuple(x.shape), kind, profile, first_position=30)
    assert torch.equal(decoded[:, :1], quantize.dequantize_cachegen(
        quantize.quantize_cachegen(x[:, :1], torch.ones(LAYERS), False, profile.component_steps(0.8)), 1, False))
    # Past the 8-bit first token, each component is off by at most half the one step, in weighted units.
    step = float(profile.component_steps(settings.bins[0])[0][0])
    error = profile.transform.forward(decoded[:, 1:], 31) - profile.transform.forward(x[:, 1:], 31)
    assert error.abs().max() <= step / 2 * (1 + 1e-4)
    assert error.abs().max() > step / 10  # the components were quantized, not passed through


def test_decorrelated_components_cost_fewer_bytes_at_the_same_weighted_error():
    """On correlated heads, components at one step take fewer bytes than channels at the sensitivity steps, with
    no more squared error in weighted units (what the steps hold equal)."""
    profile = profile_of("v")
    x = correlated(600, seed=21, rotary=False)
    weight = torch.from_numpy(profile.transform.weight).reshape(LAYERS, 1, HEADS * DIM)
    results = {}
    for name, transform in (("channels", False), ("components", True)):
        settings = dataclasses.replace(IMPORTANCE_LEVELS["medium"], token_steps=False, transform=transform)
        sections = codec.encode_tensor(x, settings, "v", profile)
        decoded = codec.decode_tensor(sections, settings, tuple(x.shape), "v", profile)
        results[name] = (sum(map(len, sections.values())), ((decoded - x)[:, 1:] * weight).square().mean().item())
    (channel_bytes, channel_error), (component_bytes, component_error) = results["channels"], results["components"]
    assert component_bytes < 0.8 * channel_bytes
    assert component_error < 1.2 * channel_error


def test_transform_needs_the_profile_and_its_settings():
    x = correlated(30, seed=1, rotary=True)
    profile = profile_of("k")
    sections = codec.encode_tensor(x, dataclasses.replace(MEDIUM, token_steps=False), "k", profile)
    with pytest.raises(KvstrataError, match="version 5"):
        codec.decode_tensor(sections, dataclasses.replace(MEDIUM, token_steps=False), tuple(x.shape), "k", None)
    without = TensorProfile(profile.differences, profile.direct, profile.sigma, profile.sensitivity)
    with pytest.raises(KvstrataError, match="transform"):
        codec.encode_tensor(x, dataclasses.replace(MEDIUM, token_steps=False), "k", without)
    with pytest.raises(ValueError, match="steps"):
        codec.encode_tensor(x, dataclasses.replace(MEDIUM, token_steps=False), "k", profile,
                            steps=profile.steps(1.0))
    with pytest.raises(KvstrataError, match="differences 'none'") as err:
        CodecSettings(differences="k", allocation="sensitivity", bins=(1, 1, 1), transform=True)
    assert "'k'" in str(err.value)
    assert settings_for("medium", profiled=True, token_steps=True, transform=True) == MEDIUM
    assert settings_for("medium", profiled=True, token_steps=True) == IMPORTANCE_LEVELS["medium"]
    assert CodecSettings.from_json({k: v for k, v in IMPORTANCE_LEVELS["low"].to_json().items() if k != "transform"}
                                   ) == IMPORTANCE_LEVELS["low"]  # written before transforms existed


def test_profiles_keep_their_transforms(tmp_path):
    profile = codec_profile()
    profile.save(tmp_path / "p.npz")
    loaded = CodecProfile.load(tmp_path / "p.npz", "abcd1234abcd1234")
    assert loaded.digest == profile.digest and loaded.has_transforms
    for kind in ("k", "v"):
        mine, theirs = getattr(profile, kind).transform, getattr(loaded, kind).transform
        assert np.array_equal(mine.rotation, theirs.rotation) and np.array_equal(mine.mean, theirs.mean)
        assert np.array_equal(mine.weight, theirs.weight)
    assert loaded.v.transform.inverse_frequencies is None
    assert np.array_equal(loaded.k.transform.inverse_frequencies, FREQUENCIES)
    x = correlated(40, seed=3, rotary=True)
    settings = dataclasses.replace(MEDIUM, token_steps=False)
    sections = codec.encode_tensor(x, settings, "k", profile.k, first_position=9)
    assert torch.equal(codec.decode_tensor(sections, settings, tuple(x.shape), "k", loaded.k, 9),
                       codec.decode_tensor(sections, settings, tuple(x.shape), "k", profile.k, 9))


def test_a_profile_without_transforms_is_written_as_version_4():
    """So a version-4 profile keeps its digest, which the files coded with it name."""
    profile = codec_profile()
    old = CodecProfile("abcd1234abcd1234", *(dataclasses.replace(p, transform=None) for p in (profile.k, profile.v)), 4)
    with np.load(io.BytesIO(old.to_bytes())) as data:
        assert b'"version": 4' in bytes(data["meta"]) and not any("transform" in name for name in data.files)
    assert old.digest != profile.digest
    with pytest.raises(ValueError, match="both K and V"):
        CodecProfile("abcd1234abcd1234", profile.k, old.v, 4).to_bytes()


def test_the_profile_shipped_before_the_transforms_still_opens_its_contexts():
    """Contexts saved with the replaced version-4 profile name its digest; the reader finds it among the replaced."""
    fingerprint, digest = "787d6421b9f1d1d8", "1cb4bb796675571a"
    replaced = shipped_profile(fingerprint, digest)
    assert replaced.digest == digest and not replaced.has_transforms
    current = shipped_profile(fingerprint)
    assert current.has_transforms and current.digest != digest
    assert shipped_profile(fingerprint, "0" * 16) is current


def broken(tmp_path, change) -> Path:
    profile = codec_profile()
    with np.load(io.BytesIO(profile.to_bytes())) as data:
        arrays = {name: data[name] for name in data.files}
    change(arrays)
    np.savez(tmp_path / "bad.npz", **arrays)
    return tmp_path / "bad.npz"


@pytest.mark.parametrize(("change", "words"), [
    (lambda a: a.update(k_transform_rotation=a["k_transform_rotation"][..., :4]), ["k_transform_rotation", "shape"]),
    (lambda a: a.update(v_transform_rotation=2 * a["v_transform_rotation"]), ["v_transform_rotation", "orthogonal"]),
    (lambda a: a["v_transform_mean"].__setitem__((0, 0, 0), np.nan), ["v_transform_mean", "non-finite"]),
    (lambda a: a.update(k_transform_inverse_frequencies=a["k_transform_inverse_frequencies"][:2]),
     ["k_transform_inverse_frequencies", "shape"]),
    (lambda a: a.pop("k_transform_inverse_frequencies"), ["lacks", "k_transform_inverse_frequencies"]),
    (lambda a: a.pop("v_transform_mean"), ["lacks", "v_transform_mean"]),
    (lambda a: a["k_sensitivity"].__setitem__((1, slice(0, DIM)), 0.0), ["k_sensitivity", "whole head"]),
], ids=["rotation-shape", "not-orthogonal", "nan-mean", "frequencies-shape", "no-frequencies", "no-mean",
        "dead-head"])
def test_broken_transforms_are_refused_by_name(tmp_path, change, words):
    with pytest.raises(CorruptStreamError) as err:
        CodecProfile.load(broken(tmp_path, change), "abcd1234abcd1234")
    for word in words:
        assert word in str(err.value)
    assert "bad.npz" in str(err.value)


@pytest.mark.parametrize("tokens", [1, 2])
def test_chunks_of_one_or_two_tokens(tokens):
    profile = profile_of("k")
    x = correlated(tokens, seed=4, rotary=True)
    settings = dataclasses.replace(MEDIUM, token_steps=False)
    sections = codec.encode_tensor(x, settings, "k", profile, first_position=1536)
    decoded = codec.decode_tensor(sections, settings, tuple(x.shape), "k", profile, 1536)
    assert decoded.shape == x.shape and torch.isfinite(decoded).all()


@pytest.mark.parametrize("position", [-1, 2.0, True, "3"])
def test_a_bad_first_position_is_named(position):
    x = correlated(5, seed=4, rotary=True)
    with pytest.raises(ValueError, match="first_position") as err:
        codec.encode_tensor(x, dataclasses.replace(MEDIUM, token_steps=False), "k", profile_of("k"),
                            first_position=position)
    assert repr(position) in str(err.value)


def test_settings_flags_must_be_booleans():
    with pytest.raises(KvstrataError, match="transform must be true or false, got 'false'"):
        CodecSettings.from_json({**MEDIUM.to_json(), "transform": "false"})
