"""The KV store's pieces without a model: checked objects, stored forms, each tier, the tiers together."""

import errno
import os
import time
from types import SimpleNamespace

import pytest
import torch

from kvstrata.cachegen.profile import ProfileBuilder
from kvstrata.errors import KvstrataError
from kvstrata.kv.store.disk_tier import DiskTier
from kvstrata.kv.store.errors import CorruptObject, StoreUnavailable
from kvstrata.kv.store.forms import parse_tier_forms, stored_form, written_form
from kvstrata.kv.store.host_tier import HostTier
from kvstrata.kv.store.objects import ObjectHeader, pack_object, unpack_object
from kvstrata.kv.store.redis_tier import RedisTier
from kvstrata.kv.store.spec import parse_tiers
from kvstrata.kv.store.tiered_store import StoreShape, TieredStore

SHAPE = StoreShape("model-a/fp32@float32/", num_layers=3, kv_heads=2, head_dim=8)
TOKENS = 32


def chunk_kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SHAPE.num_layers, TOKENS, SHAPE.kv_heads, SHAPE.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def store_over(*tiers, forms=None) -> TieredStore:
    forms = forms or ["raw"] * len(tiers)
    return TieredStore(list(tiers), [stored_form(form, torch.float32) for form in forms], SHAPE)


# --- objects and forms ------------------------------------------------------------------------


def test_an_object_is_checked_for_what_it_claims_to_be():
    header = ObjectHeader("ns", "c0", "k.1", "float16", (4, 2, 8))
    data = pack_object(header, b"payload")
    assert unpack_object(data, "ns", "c0", "k.1") == (header, b"payload")
    altered = bytearray(data)
    altered[-1] ^= 1
    for bad, message in ((bytes(altered), "checksum"), (data[:-3], "checksum"), (data[:10], "truncated"),
                         (b"XXXX" + data[4:], "not a kvstrata")):
        with pytest.raises(CorruptObject, match=message):
            unpack_object(bad, "ns", "c0", "k.1")
    for namespace, chunk, name in (("other-model", "c0", "k.1"), ("ns", "c1", "k.1"), ("ns", "c0", "v.1")):
        with pytest.raises(CorruptObject, match="not this model"):
            unpack_object(data, namespace, chunk, name)


# Relative RMS error bounds. CacheGen's step is bin x the RMS of what it codes (papers/cachegen.md §2.2), so the
# error of a uniform quantizer is about bin / sqrt(12) of it: "high" codes the middle layer third at bin 0.5,
# "low" at 2 (K as differences from anchors, whose RMS on this random data is sqrt(2) times a value's).
@pytest.mark.parametrize("form, tolerance", [("raw", 0.0), ("fp16", 1e-3), ("high", 0.25), ("low", 0.9)])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_each_stored_form_gives_back_what_it_was_given(form, tolerance, kind):
    x = torch.randn(TOKENS, 2, 8, generator=torch.Generator().manual_seed(0))
    codec = stored_form(form, torch.float32)
    back = codec.decode(codec.encode(x, kind, 1, 3), (TOKENS, 2, 8), kind, 1, 3)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert (back - x).pow(2).mean().sqrt() <= tolerance * x.pow(2).mean().sqrt()


def test_sensitivity_steps_are_read_back_by_a_form_that_knows_no_profile():
    """With the model's profile, a store's CacheGen form sets its steps from the sensitivity; the steps travel
    in the object, so another engine (or a reader built from the header's form name) decodes it alike."""
    x = torch.randn(TOKENS, 2, 8, generator=torch.Generator().manual_seed(1))
    builder = ProfileBuilder()
    builder.add(torch.randn(3, 64, 16, generator=torch.Generator().manual_seed(3)))
    weights = 10 ** (4 * torch.rand(3, 16, generator=torch.Generator().manual_seed(2)) - 2)
    tensor_profile = builder.build(weights.numpy())
    profile = SimpleNamespace(k=tensor_profile, v=tensor_profile)
    writer = stored_form("medium", torch.float32, profile)
    payload = writer.encode(x, "k", 1, 3)
    assert payload != stored_form("medium", torch.float32).encode(x, "k", 1, 3)
    back = written_form("medium", profile).decode(payload, (TOKENS, 2, 8), "k", 1, 3)
    assert torch.equal(back, writer.decode(payload, (TOKENS, 2, 8), "k", 1, 3))
    # a reader that codes K as anchor differences expects other groups: the rANS stream does not fit them
    with pytest.raises(CorruptObject, match="corrupt rANS stream"):
        written_form("medium").decode(payload, (TOKENS, 2, 8), "k", 1, 3)


def test_a_payload_that_does_not_fit_its_shape_is_corrupt():
    for form in ("raw", "medium"):
        codec = stored_form(form, torch.float32)
        payload = codec.encode(torch.randn(TOKENS, 2, 8), "v", 0, 3)
        for cut in range(1, len(payload)):
            with pytest.raises(CorruptObject):
                codec.decode(payload[:cut], (TOKENS, 2, 8), "v", 0, 3)


def test_an_unknown_form_is_refused():
    with pytest.raises(KvstrataError, match="kv_store_format 'zip' is not one of raw, fp16"):
        stored_form("zip", torch.float32)


# --- tiers ------------------------------------------------------------------------------------


def test_the_host_tier_drops_the_least_recently_used_chunk_and_says_so():
    tier = HostTier(capacity=300)
    dropped = []
    tier.on_evict = lambda key, read: dropped.append((key, read()))
    tier.put("a", {"k.0": b"x" * 100})
    tier.put("b", {"k.0": b"y" * 100})
    assert tier.get("a", ["k.0"]) == {"k.0": b"x" * 100}  # "a" is now the most recent
    tier.put("c", {"k.0": b"z" * 150})
    assert dropped == [("b", {"k.0": b"y" * 100})]
    assert tier.contains("a") and tier.contains("c") and not tier.contains("b")
    assert tier.get("a", ["k.0", "v.0"]) is None  # a missing object is a miss
    tier.put("huge", {"k.0": b"h" * 400})  # larger than the whole budget: not stored, nothing dropped
    assert not tier.contains("huge") and tier.usage().chunks == 2


def test_the_disk_tier_reads_a_subset_and_finds_its_chunks_after_a_restart(tmp_path):
    tier = DiskTier(tmp_path, capacity=10_000)
    tier.put("a", {"k.0": b"k0", "v.0": b"v0", "k.1": b"k1"})
    time.sleep(0.01)
    tier.put("b", {"k.0": b"bb"})
    assert tier.get("a", ["k.1", "v.0"]) == {"k.1": b"k1", "v.0": b"v0"}
    (tmp_path / ".c.1.2.tmp").write_bytes(b"half a chunk")  # an interrupted write
    restarted = DiskTier(tmp_path, capacity=10_000)
    assert restarted.contains("a") and restarted.contains("b")
    assert restarted.get("a", ["k.0"]) == {"k.0": b"k0"}
    assert not (tmp_path / ".c.1.2.tmp").exists()
    assert restarted.usage().chunks == 2


def test_the_disk_tier_keeps_its_budget_oldest_first(tmp_path):
    tier = DiskTier(tmp_path, capacity=200)
    dropped = []
    tier.on_evict = lambda key, read: dropped.append((key, read()))
    tier.put("a", {"k.0": b"a" * 80})
    tier.put("b", {"k.0": b"b" * 80})
    tier.put("c", {"k.0": b"c" * 80})
    assert dropped == [("a", {"k.0": b"a" * 80})]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.kvc", "c.kvc"]


def test_a_full_disk_skips_the_write_and_leaves_nothing_behind(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, capacity=10_000)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(StoreUnavailable, match="No space left"):
        tier.put("a", {"k.0": b"data"})
    assert not tier.contains("a") and list(tmp_path.iterdir()) == []


def test_a_truncated_chunk_file_is_corrupt(tmp_path):
    tier = DiskTier(tmp_path, capacity=10_000)
    tier.put("a", {"k.0": b"0123456789"})
    path = tmp_path / "a.kvc"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CorruptObject, match="truncated"):
        tier.get("a", ["k.0"])


def test_a_chunk_file_whose_index_lies_is_corrupt(tmp_path):
    tier = DiskTier(tmp_path, capacity=10_000)
    tier.put("a", {"k.0": b"0123456789"})
    path = tmp_path / "a.kvc"
    data = bytearray(path.read_bytes())
    data[len(b"KVSC\x01") + 2 + 2 : len(b"KVSC\x01") + 2 + 10] = (2**62).to_bytes(8, "little")  # k.0's length
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObject, match="longer than the file"):
        tier.get("a", ["k.0"])


def test_the_redis_tier_on_a_real_server(redis_server):
    tier = RedisTier(redis_server.url)
    tier.put("a", {"k.0": b"k0", "v.0": b"v0"})
    assert tier.contains("a") and not tier.contains("b")
    assert tier.get("a", ["v.0"]) == {"v.0": b"v0"}
    assert tier.get("a", ["v.0", "k.9"]) is None
    assert tier.usage().chunks == 1
    tier.clear()
    assert not tier.contains("a")


def test_a_dead_redis_is_unavailable_at_once_then_skipped_until_it_is_back(redis_server):
    tier = RedisTier(redis_server.url, timeout=0.5, retry_seconds=0.3)
    tier.put("a", {"k.0": b"k0"})
    redis_server.stop()
    with pytest.raises(StoreUnavailable, match="EXISTS failed"):
        tier.contains("a")
    with pytest.raises(StoreUnavailable, match="skipped after a recent failure"):
        tier.contains("a")
    redis_server.start()  # same port, empty (nothing was saved)
    time.sleep(0.35)
    assert not tier.contains("a")
    tier.put("a", {"k.0": b"k0"})
    assert tier.get("a", ["k.0"]) == {"k.0": b"k0"}


# --- the tiers together -----------------------------------------------------------------------


def test_a_hit_below_is_promoted_and_counted(tmp_path):
    host, disk = HostTier(10**7), DiskTier(tmp_path, 10**8)
    store = store_over(host, disk)
    k, v = chunk_kv(0)
    disk.put("c0", store.encode("c0", k, v, store.forms[1]))
    got_k, got_v = store.fetch("c0", TOKENS)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)  # raw: exact
    assert host.contains("c0")
    assert (disk.stats.hit_tokens, host.stats.miss_tokens, host.stats.chunks_written) == (TOKENS, TOKENS, 1)
    store.fetch("c0", TOKENS)
    assert host.stats.hit_tokens == TOKENS
    assert store.fetch("c1", TOKENS) is None
    assert (host.stats.miss_tokens, disk.stats.miss_tokens) == (2 * TOKENS, TOKENS)


def test_a_put_reaches_every_tier_and_a_dropped_chunk_cascades_down(tmp_path):
    chunk_bytes = 2 * SHAPE.num_layers * TOKENS * SHAPE.kv_heads * SHAPE.head_dim * 4
    host, disk = HostTier(int(chunk_bytes * 1.5)), DiskTier(tmp_path, 10**8)
    store = store_over(host, disk)
    store.put("c0", *chunk_kv(0))
    assert host.contains("c0") and disk.contains("c0")
    disk.remove("c0")
    store.put("c1", *chunk_kv(1))  # the host tier drops c0, which the disk tier no longer holds
    assert not host.contains("c0") and disk.contains("c0") and disk.contains("c1")
    assert torch.equal(store.fetch("c0", TOKENS)[0], chunk_kv(0)[0])


def test_a_corrupt_object_is_dropped_from_its_tier(tmp_path):
    disk = DiskTier(tmp_path, 10**8)
    store = store_over(disk)
    store.put("c0", *chunk_kv(0))
    path = tmp_path / "c0.kvc"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObject, match="checksum"):
        store.fetch("c0", TOKENS)
    assert not disk.contains("c0") and store.stats.corrupt_objects == 1
    assert store.fetch("c0", TOKENS) is None


def test_objects_of_another_namespace_are_not_served(tmp_path):
    host = HostTier(10**7)
    raw = stored_form("raw", torch.float32)
    other = TieredStore([host], [raw], StoreShape("model-b/x", 3, 2, 8))
    host.put("c0", other.encode("c0", *chunk_kv(0), raw))
    with pytest.raises(CorruptObject, match="not this model"):
        store_over(host).fetch("c0", TOKENS)


def test_a_dead_tier_is_passed_over(redis_server, tmp_path):
    redis_tier, disk = RedisTier(redis_server.url, timeout=0.5), DiskTier(tmp_path, 10**8)
    store = store_over(redis_tier, disk)
    store.put("c0", *chunk_kv(0))
    redis_server.stop()
    assert torch.equal(store.fetch("c0", TOKENS)[1], chunk_kv(0)[1])  # from the disk tier
    store.put("c1", *chunk_kv(1))  # Redis is skipped, the disk tier still gets it
    assert disk.contains("c1") and redis_tier.stats.errors >= 2


def test_each_tier_writes_its_own_form_and_any_form_is_read(tmp_path):
    host, disk = HostTier(10**7), DiskTier(tmp_path, 10**8)
    store = store_over(host, disk, forms=["raw", "medium"])
    k, v = chunk_kv(0)
    store.put("c0", k, v)
    assert host.get("c0", ["k.0"])["k.0"] != disk.get("c0", ["k.0"])["k.0"]
    host.clear()
    got_k, _ = store.fetch("c0", TOKENS)  # from disk, at medium: close, not equal
    assert not torch.equal(got_k, k) and (got_k - k).pow(2).mean() < 0.2 * k.pow(2).mean()
    assert torch.equal(store.fetch("c0", TOKENS)[0], got_k)  # promoted to host re-encoded raw: the same values
    reader = store_over(HostTier(10**7), disk, forms=["raw", "raw"])  # writes raw, still reads medium objects
    assert torch.equal(reader.fetch("c0", TOKENS)[0], got_k)


def test_a_chunk_dropped_to_a_tier_of_another_form_is_re_encoded(tmp_path):
    chunk_bytes = 2 * SHAPE.num_layers * TOKENS * SHAPE.kv_heads * SHAPE.head_dim * 4
    host, disk = HostTier(int(chunk_bytes * 1.5)), DiskTier(tmp_path, 10**8)
    store = store_over(host, disk, forms=["raw", "fp16"])
    store.put("c0", *chunk_kv(0))
    disk.remove("c0")
    store.put("c1", *chunk_kv(1))  # host drops c0 (raw); it reaches the disk as fp16
    assert disk.usage().chunks == 2 and disk.usage().bytes < 0.6 * 2 * chunk_bytes  # fp16: half, plus headers
    assert torch.allclose(store.fetch("c0", TOKENS)[0], chunk_kv(0)[0], atol=2e-3)


def test_store_specifications(tmp_path, redis_server):
    tiers = parse_tiers(f"host:1MiB, disk:{tmp_path}/a:b:2GiB ,{redis_server.url}")
    assert [t.name for t in tiers] == ["host", "disk", "redis"]
    assert tiers[0].capacity == 2**20 and str(tiers[1].directory) == f"{tmp_path}/a:b" and tiers[1].capacity == 2**31
    (tmp_path / "file").write_text("")
    with pytest.raises(KvstrataError, match="cannot be created"):
        parse_tiers(f"disk:{tmp_path}/file/kv:1GiB")
    for bad, message in (("", "empty"), ("host:1MiB,,", "empty part"), ("memcached://x", "is not a tier"),
                         ("host:lots", "is not a size"), ("disk:12GiB", "needs a directory"),
                         ("host:1MiB,host:2MiB", "more than one host")):
        with pytest.raises(KvstrataError, match=message):
            parse_tiers(bad)
    names = ["host", "disk", "redis"]
    assert parse_tier_forms("medium", names) == ["medium"] * 3
    assert parse_tier_forms("host=raw, redis=low", names) == ["raw", "raw", "low"]
    for bad, message in (("zip", "not one of raw, fp16"), ("ssd=raw", "not FORM or TIER=FORM"),
                         ("host=zip", "not one of"), ("redis=raw", "which kv_store does not have")):
        with pytest.raises(KvstrataError, match=message):
            parse_tier_forms(bad, names[:2])
