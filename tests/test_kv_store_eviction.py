"""What a full host tier keeps (`--kv-store-eviction lru|lfu|score`): eviction order and admission on hand-made
traces, the uses and important shares they rank by, and loads copying the chunks they used up to a tier that
would keep them."""

import pytest
import torch

from kvstrata.config import EngineConfig
from kvstrata.errors import KvstrataError
from kvstrata.kv.store.chunk_heat import ChunkHeat
from kvstrata.kv.store.disk_tier import DiskTier
from kvstrata.kv.store.eviction import make_policy
from kvstrata.kv.store.forms import stored_form
from kvstrata.kv.store.host_tier import HostTier
from kvstrata.kv.store.tiered_store import Located, TieredStore
from tests.test_kv_store_tiers import SHAPE, TOKENS, chunk_kv

CHUNK = {"k.0": b"x" * 100}  # every chunk of the hand-made traces: 100 bytes


def tier_of(policy: str, chunks: int, heat: ChunkHeat, holding: str = "") -> HostTier:
    """A host tier with room for `chunks` chunks, holding those named in `holding`, stored in order."""
    tier = HostTier(capacity=100 * chunks, policy=make_policy(policy, heat))
    for key in holding:
        tier.put(key, CHUNK)
    return tier


def uses(heat: ChunkHeat, trace: str, important: dict[str, float] | None = None) -> None:
    """One use of each chunk named in `trace`, in order ("aab": a twice, then b)."""
    for key in trace:
        heat.record(key, (important or {}).get(key))


@pytest.mark.parametrize("policy, dropped", [("lru", "a"), ("lfu", "b"), ("score", "b")])
def test_each_policy_drops_its_least_valued_chunk(policy, dropped):
    heat = ChunkHeat()
    tier = tier_of(policy, 3, heat, holding="abc")
    for key in "acacb":  # a and c are used twice, b once and last
        heat.record(key)
        tier.used(key)
    uses(heat, "dd")  # d is used twice, from below
    assert tier.put("d", CHUNK)
    assert sorted(tier.stored_keys()) == sorted(set("abcd") - {dropped})


def test_score_weighs_uses_by_the_important_share_lfu_does_not():
    """The paper's example: chunk A, 1 important token of 4, used 3 times; chunk B, 2 of 4, used twice. LFU keeps
    A (3 uses against 2); IMPRESS keeps B (2 x 2/4 = 1 against 3 x 1/4)."""
    kept = {}
    for policy in ("lfu", "score"):
        heat = ChunkHeat()
        tier = tier_of(policy, 1, heat)
        uses(heat, "aaabb", {"a": 0.25, "b": 0.5})
        tier.put("a", CHUNK)
        tier.put("b", CHUNK)
        tier.put("a", CHUNK)
        tier.put("b", CHUNK)
        kept[policy] = tier.stored_keys()
    assert kept == {"lfu": ["a"], "score": ["b"]}


def test_a_chunk_worth_no_more_than_the_minimum_is_refused_and_counted():
    heat = ChunkHeat()
    uses(heat, "ab")
    tier = tier_of("score", 2, heat, holding="ab")
    assert not tier.put("new", CHUNK)  # never used: worth 0
    heat.record("used", 1.0)  # one use: ties with a and b, which stay
    assert not tier.put("used", CHUNK)
    assert tier.stats.chunks_refused == 2 and sorted(tier.stored_keys()) == ["a", "b"]
    assert not tier.would_keep("used")
    heat.record("used", 1.0)
    assert tier.would_keep("used") and tier.put("used", CHUNK)
    assert sorted(tier.stored_keys()) == ["b", "used"]  # a and b tie: the one stored first goes
    lru = tier_of("lru", 1, ChunkHeat())
    lru.put("a", CHUNK)
    assert lru.put("new", CHUNK) and lru.stored_keys() == ["new"]  # lru takes every chunk


def test_a_tier_with_room_keeps_any_chunk():
    tier = tier_of("score", 4, ChunkHeat())
    tier.put("a", CHUNK)
    assert tier.would_keep("never-used") and tier.put("never-used", CHUNK)


def test_a_value_that_falls_moves_the_chunk_down_the_heap():
    heat = ChunkHeat()
    uses(heat, "aabb")
    tier = tier_of("score", 2, heat, holding="ab")
    heat.record("a", 0.1)  # a third use, but a selective load chose a tenth of it: 0.3 < b's 2
    tier.used("a")
    uses(heat, "cc")
    assert tier.put("c", CHUNK)
    assert sorted(tier.stored_keys()) == ["b", "c"]


def test_the_heat_table_halves_its_counts_when_full_and_the_tiers_rescore():
    heat = ChunkHeat(max_entries=3)
    uses(heat, "aaaabb")
    tier = tier_of("lfu", 2, heat, holding="ab")
    rescored = []
    heat.on_aged.append(lambda: (rescored.append(True), tier.rescore()))
    heat.record("c")
    heat.record("d")  # a fourth entry: counts halve, those below one use are forgotten
    assert rescored == [True]
    assert (heat.uses("a"), heat.uses("b"), heat.uses("c"), heat.uses("d")) == (2, 1, 0, 0)
    uses(heat, "cc")  # c: 2 uses now beats b's 1
    assert tier.put("c", CHUNK) and sorted(tier.stored_keys()) == ["a", "c"]
    with pytest.raises(ValueError, match="must be in"):
        heat.record("a", 1.5)


def test_a_load_using_part_of_a_chunk_below_copies_it_up_when_it_beats_the_host_minimum(tmp_path):
    heat = ChunkHeat()
    k, v = chunk_kv(0)
    host, disk = HostTier(capacity=1, policy=make_policy("score", heat)), DiskTier(tmp_path, 10**8)
    store = TieredStore([host, disk], [stored_form("raw", torch.float32)] * 2, SHAPE, heat=heat)
    size = sum(len(data) for data in store.encode("c0", k, v, store.forms[1]).values())
    host.capacity = size  # room for one chunk
    store.put("c0", k, v)
    store.put("c1", *chunk_kv(1))
    assert host.stored_keys() == ["c0"] and disk.contains("c1")  # c1 (never used) was refused
    store.note_use(Located("c0", 0), TOKENS, 0.25)
    store.note_use(Located("c1", 1), TOKENS, 0.5)  # 1 x 0.5 beats c0's 1 x 0.25: copied up, c0 dropped
    assert host.stored_keys() == ["c1"] and host.stats.chunks_promoted == 1
    assert host.get("c1", None) == disk.get("c1", None)  # copied as stored
    assert disk.stats.bytes_promoted == size and disk.stats.bytes_read == 0  # off the load's path
    assert (host.stats.chunk_hits, host.stats.chunk_misses, disk.stats.chunk_hits) == (1, 1, 1)
    assert (host.stats.important_hits, host.stats.important_misses) == (0.25, 0.5)
    store.note_use(Located("c0", 1), TOKENS, 0.25)  # c0: 2 x 0.25 = 0.5, no more than c1's: stays below
    assert host.stored_keys() == ["c1"] and host.stats.chunks_promoted == 1


def test_the_eviction_option_is_checked():
    assert EngineConfig(kv_store_eviction="score").kv_store_eviction == "score"
    with pytest.raises(KvstrataError, match="kv_store_eviction 'fifo' is not one of lru, lfu, score"):
        EngineConfig(kv_store_eviction="fifo")


def test_importance_loads_count_their_chunks_and_bring_them_up_to_the_host_tier(tiny_llama, tmp_path):
    """A fresh engine whose host tier is empty loads every prefix from disk by importance: each chunk it read is
    counted with the share of it chosen, and copied up; asked again (the device pool forgotten), the prompts find
    their chunks in host memory, with the same outputs."""
    from tests.test_kv_store_engine import PROMPTS, make_engine, run_rounds

    options = {"prefix_loading": "impress", "impress_ratio": 0.3, "kv_store_eviction": "score"}
    run_rounds(make_engine(tiny_llama, kv_store=f"disk:{tmp_path}/kv:64MiB", **options), rounds=1)
    engine = make_engine(tiny_llama, kv_store=f"host:64MiB,disk:{tmp_path}/kv:64MiB", **options)
    outputs = run_rounds(engine, rounds=2, between=lambda _: engine.reset_prefix_cache())
    host, disk = engine.kv_store.store.tiers
    heat = engine.kv_store.store.heat
    assert disk.stats.chunk_hits > 0 and host.stats.chunks_promoted > 0 and host.stats.chunk_hits > 0
    used = [key for key in host.stored_keys() if heat.uses(key) == 2]  # once from disk, once from host
    assert used and min(heat.important_share(key) for key in used) < 1
    assert all(outputs[f"0-{i}"] == outputs[f"1-{i}"] for i in range(len(PROMPTS)))
    assert engine.kv_store.important_stats.loads == 2 * len(PROMPTS)
