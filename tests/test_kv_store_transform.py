"""The KV store's CacheGen objects coded over each KV head's decorrelated components (kv/store/forms.py): they
need the chunk's position and the model's profile, and a store without them still never decodes them wrongly."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvstrata.cachegen.levels import COMPONENT_LEVELS, SENSITIVITY_LEVELS, settings_for
from kvstrata.kv.store.disk_tier import DiskTier
from kvstrata.kv.store.errors import CorruptObject
from kvstrata.kv.store.forms import stored_form, written_form
from kvstrata.kv.store.host_tier import HostTier
from kvstrata.kv.store.objects import MAGIC, PREAMBLE, VERSION, _digest, unpack_object
from kvstrata.kv.store.tiered_store import StoreShape, TieredStore
from tests.transform_cases import DIM, HEADS, LAYERS, codec_profile, correlated

SHAPE = StoreShape("model-a/fp32@float32/", num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM)
TOKENS = 24


def chunk_at(position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [layers, TOKENS, heads, dim] of the tokens at `position` ... of a context (keys rotated by RoPE at
    their positions, as the cache holds them)."""
    end = position + TOKENS
    k = correlated(end, seed=7, rotary=True)[:, position:]
    v = correlated(end, seed=8, rotary=False)[:, position:]
    return k.reshape(LAYERS, TOKENS, HEADS, DIM), v.reshape(LAYERS, TOKENS, HEADS, DIM)


def store_over(*tiers, forms, profile) -> TieredStore:
    return TieredStore(list(tiers), [stored_form(form, torch.float32, profile) for form in forms], SHAPE,
                       profile=profile)


def header_of(tier, key: str, name: str = "k.1", level: str | None = None):
    field = name if level is None else f"{level}/{name}"  # where the levels form keeps a level's object
    return unpack_object(tier.get(key, [field])[field], SHAPE.namespace, key, name)[0]


def test_store_levels_over_components_are_the_sensitivity_levels_with_a_transform():
    for level, settings in COMPONENT_LEVELS.items():
        assert settings_for(level, profiled=True, transform=True) == settings
        assert settings.transform and not settings.token_steps
        assert settings.bins[0] < SENSITIVITY_LEVELS[level].bins[0]  # smaller bins: a bin over components loses more
    # near-lossless keeps its channel steps: it promises every value's precision
    assert settings_for("near-lossless", profiled=True, transform=True) == SENSITIVITY_LEVELS["near-lossless"]


def test_a_chunk_with_its_position_is_coded_over_components_and_read_back():
    profile = codec_profile()
    host = HostTier(10**7)
    store = store_over(host, forms=["medium"], profile=profile)
    k, v = chunk_at(100)
    store.put("c0", k, v, position=100)
    header = header_of(host, "c0")
    assert (header.form, header.position) == ("medium+transform", 100)
    got_k, got_v = store.fetch("c0", TOKENS)
    for got, x in ((got_k, k), (got_v, v)):
        assert not torch.equal(got, x) and (got - x).pow(2).mean() < 0.02 * x.pow(2).mean()
    # the same values coded over channels cost more bytes
    channels = store_over(HostTier(10**7), forms=["medium"], profile=profile)
    channels.put("c0", k, v)  # no position: the tokens' order is not known
    assert header_of(channels.tiers[0], "c0").form == "medium"
    component_bytes = host.usage().bytes
    assert component_bytes < channels.tiers[0].usage().bytes


def test_the_position_undoes_rope_so_a_wrong_one_decodes_worse():
    profile = codec_profile()
    form = stored_form("medium", torch.float32, profile).at(60)
    k = chunk_at(60)[0][1]
    payload = form.encode(k, "k", 1, LAYERS, 60)
    right = form.decode(payload, tuple(k.shape), "k", 1, LAYERS, 60)
    wrong = form.decode(payload, tuple(k.shape), "k", 1, LAYERS, 30)
    assert (right - k).pow(2).mean() * 10 < (wrong - k).pow(2).mean()
    with pytest.raises(CorruptObject, match="anchor scales"):  # at 0 the first token would be an anchor
        form.decode(payload, tuple(k.shape), "k", 1, LAYERS, 0)
    with pytest.raises(CorruptObject, match="need a position"):
        form.decode(payload, tuple(k.shape), "k", 1, LAYERS, None)


def test_a_store_without_the_profile_refuses_component_objects_and_drops_them(tmp_path):
    profile = codec_profile()
    disk = DiskTier(tmp_path, 10**8)
    store_over(disk, forms=["low"], profile=profile).put("c0", *chunk_at(0), position=0)
    with pytest.raises(CorruptObject, match="profile with transforms"):
        store_over(disk, forms=["low"], profile=None).fetch("c0", TOKENS)
    assert not disk.contains("c0")
    with pytest.raises(CorruptObject, match="does not know"):
        written_form("medium+zip", profile)


def test_a_chunk_moving_between_tiers_keeps_its_position_and_its_form(tmp_path):
    profile = codec_profile()
    chunk_bytes = 2 * LAYERS * TOKENS * HEADS * DIM * 4
    host, disk = HostTier(int(chunk_bytes * 1.5)), DiskTier(tmp_path, 10**8)
    store = store_over(host, disk, forms=["raw", "high"], profile=profile)
    store.put("c0", *chunk_at(256), position=256)
    disk.remove("c0")
    store.put("c1", *chunk_at(512), position=512)  # the host tier drops c0: re-encoded for the disk at its position
    assert (header_of(disk, "c0").form, header_of(disk, "c0").position) == ("high+transform", 256)
    host.clear()
    k, _ = store.fetch("c0", TOKENS)  # from the disk, then promoted to the host tier as raw, position kept
    assert (k - chunk_at(256)[0]).pow(2).mean() < 0.01 * k.pow(2).mean()
    assert (header_of(host, "c0").form, header_of(host, "c0").position) == ("float32", 256)


def test_the_levels_form_writes_each_level_over_components_where_it_has_them():
    profile = codec_profile()
    host = HostTier(10**7)
    store = store_over(host, forms=["levels"], profile=profile)
    store.put("c0", *chunk_at(30), position=30)
    forms = {level: header_of(host, "c0", "v.2", level).form
             for level in ("float16", "near-lossless", "high", "medium", "low")}
    assert forms == {"float16": "float16", "near-lossless": "near-lossless", "high": "high+transform",
                     "medium": "medium+transform", "low": "low+transform"}
    where = store.find("c0", TOKENS)
    fetched = store.read(where, level="low")
    for got, exact in zip(store.decode(fetched, TOKENS), chunk_at(30)):
        assert (got - exact).pow(2).mean() < 0.1 * exact.pow(2).mean()  # low: the coarsest level


def test_a_chunk_read_at_two_levels_decodes_each_run_of_layers_in_its_own_form():
    """A streamed load reads its first chunk's first layers at the best level (its probe), the rest at the level
    it then chooses: one chunk, objects in two forms."""
    profile = codec_profile()
    store = store_over(HostTier(10**7), forms=["levels"], profile=profile)
    k, v = chunk_at(40)
    store.put("c0", k, v, position=40)
    where = store.find("c0", TOKENS)
    probe = store.read(where, level="float16", layers=range(1))
    got_k, got_v = store.decode(probe.joined(store.read(where, level="medium", layers=range(1, LAYERS))), TOKENS)
    assert torch.allclose(got_k[0], k[0], atol=2e-2) and torch.allclose(got_v[0], v[0], atol=2e-2)  # float16
    whole_k, whole_v = store.decode(store.read(where, level="medium"), TOKENS)
    assert torch.allclose(got_k[1:], whole_k[1:], atol=1e-5) and torch.allclose(got_v[1:], whole_v[1:], atol=1e-5)
    assert store.stats.corrupt_objects == 0


def test_objects_written_before_positions_still_read_and_a_bad_position_is_refused():
    host = HostTier(10**7)
    store = store_over(host, forms=["medium"], profile=codec_profile())
    k, v = chunk_at(0)
    store.put("c0", k, v)  # over channels
    head, payload = unpack_object(host.get("c0", ["k.1"])["k.1"], SHAPE.namespace, "c0", "k.1")
    fields = {name: value for name, value in dataclasses.asdict(head).items() if name != "position"}
    old = json.dumps(fields, separators=(",", ":")).encode()  # a header as the previous version wrote it
    data = PREAMBLE.pack(MAGIC, VERSION, len(old), _digest(old, payload)) + old + payload
    assert unpack_object(data, SHAPE.namespace, "c0", "k.1")[0].position is None
    assert torch.equal(store.decode_object("c0", "k.1", data, TOKENS), store.decode_object(
        "c0", "k.1", host.get("c0", ["k.1"])["k.1"], TOKENS))
    for bad in (-1, 2**40, 1.5, "7"):
        header = json.dumps({**fields, "position": bad}, separators=(",", ":")).encode()
        data = PREAMBLE.pack(MAGIC, VERSION, len(header), _digest(header, payload)) + header + payload
        with pytest.raises(CorruptObject, match="names the position"):
            unpack_object(data, SHAPE.namespace, "c0", "k.1")
