"""Transform coding (kvstrata/cachegen/transform.py): each KV head's channels decorrelated before quantization."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvstrata.cachegen import codec, quantize
from kvstrata.cachegen.errors import CorruptStreamError
from kvstrata.cachegen.levels import IMPORTANCE_LEVELS, TRANSFORM_LEVELS, CodecSettings, settings_for
from kvstrata.cachegen.profile import CodecProfile, ProfileBuilder, TensorProfile
from kvstrata.cachegen.transform import MomentBuilder, rope_angles
from kvstrata.errors import KvstrataError
from kvstrata.model.rotary import apply_rope

LAYERS, HEADS, DIM = 3, 2, 8
FREQUENCIES = 1.0 / 100.0 ** (np.arange(0, DIM, 2) / DIM)
MEDIUM = TRANSFORM_LEVELS["medium"]


def correlated(tokens: int, seed: int, rotary: bool) -> torch.Tensor:
    """[L, T, H * D] whose heads' vectors (before RoPE, for keys) lie near two directions, plus a large offset;
    keys then rotated by RoPE at positions 0 ... T - 1, as a cache holds them."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(LAYERS, HEADS, 2, DIM, generator=torch.Generator().manual_seed(99))
    heads = torch.einsum("lthr,lhrd->lthd", 3 * torch.randn(LAYERS, tokens, HEADS, 2, generator=g), basis)
    heads = heads + 0.05 * torch.randn(LAYERS, tokens, HEADS, DIM, generator=g) + 2.0
    if rotary:
        heads = apply_rope(heads.double(), *rope_angles(FREQUENCIES, 0, tokens)).float()
    return heads.reshape(LAYERS, tokens, HEADS * DIM)


def sensitivity(seed: int = 5) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(LAYERS, HEADS * DIM, generator=g) + 0.1).numpy()


def profile_of(kind: str, windows: int = 4, tokens: int = 200) -> TensorProfile:
    rotary = kind == "k"
    builder = ProfileBuilder(MomentBuilder(HEADS, FREQUENCIES if rotary else None))
    for seed in range(windows):
        builder.add(correlated(tokens, seed, rotary))
    return builder.build(sensitivity())


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


def test_profiles_keep_their_transforms_and_refuse_broken_ones(tmp_path):
    profile = CodecProfile("abcd1234abcd1234", profile_of("k"), profile_of("v"), 4)
    profile.save(tmp_path / "p.npz")
    loaded = CodecProfile.load(tmp_path / "p.npz", "abcd1234abcd1234")
    assert loaded.digest == profile.digest
    for kind in ("k", "v"):
        mine, theirs = getattr(profile, kind).transform, getattr(loaded, kind).transform
        assert np.array_equal(mine.rotation, theirs.rotation) and np.array_equal(mine.mean, theirs.mean)
        assert np.array_equal(mine.weight, theirs.weight)
    assert loaded.v.transform.inverse_frequencies is None
    assert np.array_equal(loaded.k.transform.inverse_frequencies, FREQUENCIES)
    # A version-4 profile (no transforms) still loads, and codes without them.
    old = CodecProfile("abcd1234abcd1234", *(dataclasses.replace(p, transform=None) for p in (profile.k, profile.v)), 4)
    with np.load(tmp_path / "p.npz") as data:
        arrays = {name: data[name] for name in data.files if "transform" not in name}
    arrays["meta"] = np.frombuffer(bytes(arrays["meta"]).replace(b'"version": 5', b'"version": 4'), dtype=np.uint8)
    np.savez(tmp_path / "v4.npz", **arrays)
    assert CodecProfile.load(tmp_path / "v4.npz", "abcd1234abcd1234").k.transform is None
    assert old.k.transform is None
    # A rotation of the wrong shape is refused by name.
    with np.load(tmp_path / "p.npz") as data:
        arrays = {name: data[name] for name in data.files}
    arrays["k_transform_rotation"] = arrays["k_transform_rotation"][..., :4]
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(CorruptStreamError, match="k transform"):
        CodecProfile.load(tmp_path / "bad.npz", "abcd1234abcd1234")
