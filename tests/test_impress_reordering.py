"""IMPRESS's reordering (kv/impress/node_reordering.py): a node's tokens sorted per layer by running importance and
written as physical chunks under a map. Reads through the map give exactly the logical K/V, touch fewer chunks
when the chosen tokens are the important ones, and stay consistent while a reorder races with them."""

import threading

import pytest
import torch

from kvstrata.config import EngineConfig
from kvstrata.engine.important_prefix_load import ChunkGone, StorePrefix
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.kv.impress.important_tokens import read_with
from kvstrata.kv.impress.node_reordering import (
    NODE_CHUNKS,
    importance_key,
    map_key,
    physical_key,
    read_map,
    record_importance,
    reorder_all,
    reorder_node,
)
from kvstrata.kv.store.errors import StoreUnavailable
from kvstrata.kv.store.forms import FloatForm
from kvstrata.kv.store.host_tier import HostTier
from kvstrata.kv.store.tiered_store import StoreShape, TieredStore
from tests.test_kv_store_engine import random_prompt

LAYERS, KV_HEADS, DIM, CHUNK = 2, 2, 4, 4
TOKENS = NODE_CHUNKS * CHUNK


def make_store() -> TieredStore:
    shape = StoreShape("test/", LAYERS, KV_HEADS, DIM)
    return TieredStore([HostTier(1 << 26)], [FloatForm(torch.float32)], shape, probe_kv_heads=1)


@pytest.fixture
def node():
    """A store holding one node's logical chunks (keys "c0".."c15": the node is named "c15"), its K and V."""
    torch.manual_seed(0)
    store = make_store()
    k = torch.randn(LAYERS, TOKENS, KV_HEADS, DIM)
    v = torch.randn(LAYERS, TOKENS, KV_HEADS, DIM)
    keys = [f"c{i}" for i in range(NODE_CHUNKS)]
    for i, key in enumerate(keys):
        store.put(key, k[:, i * CHUNK : (i + 1) * CHUNK], v[:, i * CHUNK : (i + 1) * CHUNK])
    return store, keys, k, v


def prefix(store: TieredStore, keys: list[str]) -> StorePrefix:
    return StorePrefix(store, [store.find(key, CHUNK) for key in keys], CHUNK, "impress")


def test_a_node_is_sorted_by_its_running_importance(node):
    store, keys, k, v = node
    first, second = torch.rand(LAYERS, TOKENS), torch.rand(LAYERS, TOKENS)
    record_importance(store, keys[-1], keys, first)
    record_importance(store, keys[-1], keys, second)
    assert reorder_node(store, keys[-1], CHUNK)
    share = (first / first.sum(1, keepdim=True) + second / second.sum(1, keepdim=True)) / 2
    node_map = read_map(store, keys[-1], TOKENS)
    assert node_map.version == 1 and node_map.loads == 2
    in_order = share.gather(1, node_map.order)  # the importance stored is float16: equal up to its rounding
    assert (in_order[:, :-1] >= in_order[:, 1:] - 1e-3 * in_order[:, 1:]).all()
    got = store.read_objects(store.find(physical_key(keys[-1], 1, 0), CHUNK), ["k.1", "v.0"], CHUNK)[0]
    assert torch.equal(got["k.1"], k[1, node_map.order[1, :CHUNK]])
    assert torch.equal(got["v.0"], v[0, node_map.order[0, :CHUNK]])
    assert not reorder_node(store, keys[-1], CHUNK)  # nothing new to sort by


def test_reads_through_the_map_equal_the_logical_rows_and_touch_fewer_chunks(node):
    store, keys, k, v = node
    important = torch.zeros(LAYERS, TOKENS)
    chosen = torch.zeros(TOKENS, dtype=torch.bool)
    chosen[torch.randperm(TOKENS)[: TOKENS // 4]] = True  # spread over the node: touches most logical chunks
    important[:, chosen] = 1.0
    before = prefix(store, keys)
    logical = before.chosen_kv(1, chosen)
    record_importance(store, keys[-1], keys, important)
    reorder_node(store, keys[-1], CHUNK)
    after = prefix(store, keys)
    assert after.segments[0][1] is not None
    reordered = after.chosen_kv(1, chosen)
    assert torch.equal(reordered[0], k[1, chosen]) and torch.equal(reordered[1], v[1, chosen])
    assert torch.equal(logical[0], reordered[0]) and torch.equal(logical[1], reordered[1])
    assert after.chunk_reads == NODE_CHUNKS // 4 < before.chunk_reads
    everything = torch.ones(TOKENS, dtype=torch.bool)
    assert torch.equal(after.chosen_kv(0, everything)[0], k[0])


def test_a_reordered_node_is_read_in_its_physical_chunks(node):
    """A token's read unit is the physical chunk holding it: once the important quarter of a node shares a quarter
    of its chunks, reading their chunk-mates too adds nothing to it, where the logical chunks add most of the node."""
    store, keys, _, _ = node
    important = torch.zeros(TOKENS, dtype=torch.bool)
    important[torch.randperm(TOKENS)[: TOKENS // 4]] = True
    before = prefix(store, keys)
    assert torch.equal(before.read_units(1), torch.arange(TOKENS) // CHUNK)
    assert read_with(important, before.read_units(1)).sum() > 2 * important.sum()
    record_importance(store, keys[-1], keys, important.float().expand(LAYERS, -1))
    reorder_node(store, keys[-1], CHUNK)
    after = prefix(store, keys)
    units = after.read_units(1)
    assert torch.equal(units, after.segments[0][1][1].physical[1] // CHUNK)
    assert torch.equal(read_with(important, units), important)
    one = torch.zeros(TOKENS, dtype=torch.bool)
    one[0] = True
    assert read_with(one, units).sum() == CHUNK and torch.equal(read_with(one, units), units == units[0])


def test_a_prefix_with_a_tail_reads_the_node_through_its_map_and_the_tail_as_stored(node):
    store, keys, k, v = node
    tail_k, tail_v = torch.randn(LAYERS, CHUNK, KV_HEADS, DIM), torch.randn(LAYERS, CHUNK, KV_HEADS, DIM)
    store.put("tail", tail_k, tail_v)
    before = prefix(store, [*keys, "tail"])
    probe_keys = before.scoring_keys(1)
    record_importance(store, keys[-1], keys, torch.rand(LAYERS, TOKENS))
    reorder_node(store, keys[-1], CHUNK)
    reader = prefix(store, [*keys, "tail"])
    assert torch.equal(reader.scoring_keys(1), probe_keys)  # the node's from its sidecar, in one read
    assert torch.equal(probe_keys, torch.cat((k[1], tail_k[1]))[:, :1].half().float())
    chosen = torch.rand(TOKENS + CHUNK) < 0.3
    for tail_chosen in (True, False):  # a run holding no chosen token reads nothing
        chosen[TOKENS:] = tail_chosen
        got_k, got_v = reader.chosen_kv(0, chosen)
        assert torch.equal(got_k, torch.cat((k[0], tail_k[0]))[chosen])
        assert torch.equal(got_v, torch.cat((v[0], tail_v[0]))[chosen])
    nothing_in_the_node = torch.zeros(TOKENS + CHUNK, dtype=torch.bool)
    nothing_in_the_node[TOKENS + 1] = True
    assert torch.equal(reader.chosen_kv(1, nothing_in_the_node)[0], tail_k[1, 1:2])


def test_a_reader_holding_an_old_map_finds_its_chunks_gone_never_half_a_node(node):
    store, keys, k, _ = node
    record_importance(store, keys[-1], keys, torch.rand(LAYERS, TOKENS))
    reorder_node(store, keys[-1], CHUNK)
    old_reader = prefix(store, keys)
    record_importance(store, keys[-1], keys, torch.rand(LAYERS, TOKENS))
    reorder_node(store, keys[-1], CHUNK)  # version 2 written, version 1 removed
    with pytest.raises(ChunkGone):
        old_reader.chosen_kv(0, torch.ones(TOKENS, dtype=torch.bool))
    assert not store.stored_keys(f"r1.{keys[-1]}")
    assert torch.equal(prefix(store, keys).chosen_kv(0, torch.ones(TOKENS, dtype=torch.bool))[0], k[0])


def test_a_pass_that_fails_before_its_map_leaves_the_old_version_in_force(node, monkeypatch):
    store, keys, k, _ = node
    record_importance(store, keys[-1], keys, torch.rand(LAYERS, TOKENS))
    reorder_node(store, keys[-1], CHUNK)
    record_importance(store, keys[-1], keys, torch.rand(LAYERS, TOKENS))

    def failing(key, objects):
        if key == map_key(keys[-1]):
            raise StoreUnavailable("the map's write failed")

    with monkeypatch.context() as patch:
        patch.setattr(store, "put_record", failing)
        with pytest.raises(StoreUnavailable):
            reorder_node(store, keys[-1], CHUNK)
    reader = prefix(store, keys)
    assert reader.segments[0][1][1].version == 1
    chosen = torch.rand(TOKENS) < 0.5
    assert torch.equal(reader.chosen_kv(1, chosen)[0], k[1, chosen])


def test_reads_racing_with_reorders_see_one_version_or_fall_back(node):
    store, keys, k, v = node
    failures, errors, reads = [], [], [0]
    stop = threading.Event()

    def reorder_repeatedly():
        for _ in range(30):
            record_importance(store, keys[-1], keys, torch.rand(LAYERS, TOKENS))
            reorder_node(store, keys[-1], CHUNK)
        stop.set()

    def read_repeatedly():
        generator = torch.Generator().manual_seed(0)
        while not stop.is_set():
            chosen = torch.rand(TOKENS, generator=generator) < 0.3
            try:
                got_k, got_v = prefix(store, keys).chosen_kv(1, chosen)
            except ChunkGone:
                failures.append(1)
                continue
            reads[0] += 1
            if not (torch.equal(got_k, k[1, chosen]) and torch.equal(got_v, v[1, chosen])):
                errors.append(1)

    threads = [threading.Thread(target=reorder_repeatedly), threading.Thread(target=read_repeatedly)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and reads[0] > 0


def test_a_corrupt_map_is_removed_and_the_node_read_as_stored(node):
    store, keys, k, _ = node
    record_importance(store, keys[-1], keys, torch.rand(LAYERS, TOKENS))
    reorder_node(store, keys[-1], CHUNK)
    tier = store.tiers[0]
    data = tier.get(map_key(keys[-1]), ["map"])["map"]
    tier.remove(map_key(keys[-1]))
    tier.put(map_key(keys[-1]), {"map": data[:-3] + b"xyz"})
    reader = prefix(store, keys)
    assert reader.segments[0][1] is None and not tier.contains(map_key(keys[-1]))
    assert torch.equal(reader.chosen_kv(0, torch.ones(TOKENS, dtype=torch.bool))[0], k[0])


def engine(model, tmp_path, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), kv_cache_memory="480KiB", threads=1, kv_store_chunk_tokens=8,
                                  kv_store=f"disk:{tmp_path}/kv:64MiB", prefix_loading="impress", impress_ratio=0.25,
                                  impress_reorder_seconds=0, **options))


def generate(model, tmp_path, prompts, **options) -> tuple[list[list[int]], LLMEngine]:
    fresh = engine(model, tmp_path, **options)
    for index, prompt in enumerate(prompts):
        fresh.add_request(prompt, SamplingParams(temperature=0, max_tokens=6), request_id=str(index))
    outputs = {}
    while fresh.has_unfinished_requests():
        outputs.update({out.request_id: out.token_ids for out in fresh.step() if out.finished})
    fresh.kv_store.close()
    return [outputs[str(index)] for index in range(len(prompts))], fresh


def test_the_engine_reads_a_reordered_prefix_as_it_read_it_before(tiny_llama, tmp_path):
    """Reordering moves bytes, never changes what a layer chooses: attending only the chosen tokens, the same greedy
    output before and after the pass, from fewer (chunk, layer) reads. (Attending every token read, the chosen
    tokens' chunk-mates change with the chunks: test_a_reordered_node_is_read_in_its_physical_chunks.)"""
    prefix_ids = random_prompt(7, NODE_CHUNKS * 8)
    prompts = [prefix_ids + random_prompt(seed, 20) for seed in (8, 9)]
    generate(tiny_llama, tmp_path, prompts[:1])  # stores the prefix
    # loads it by importance, recording what was read
    before, loaded = generate(tiny_llama, tmp_path, prompts, impress_attend="chosen")
    assert loaded.kv_store.important_stats.loads == 2
    store = engine(tiny_llama, tmp_path).kv_store.store
    assert store.stored_keys("s.") and reorder_all(store, 8) == 1
    after, reloaded = generate(tiny_llama, tmp_path, prompts, impress_attend="chosen")
    assert after == before
    assert reloaded.kv_store.important_stats.chunk_reads < loaded.kv_store.important_stats.chunk_reads
    assert importance_key(next(iter(store.stored_keys("m."))).removeprefix("m.")) in store.stored_keys("s.")


def test_the_store_command_runs_a_pass_now(tiny_llama, tmp_path, capsys):
    from kvstrata.cli.main import main

    prefix_ids = random_prompt(7, NODE_CHUNKS * 8)
    prompts = [prefix_ids + random_prompt(seed, 20) for seed in (8, 9)]
    generate(tiny_llama, tmp_path, prompts[:1])  # stores the prefix
    generate(tiny_llama, tmp_path, prompts)  # loads it by importance: its node's record
    options = ["--model", str(tiny_llama), "--kv-store", f"disk:{tmp_path}/kv:64MiB", "--kv-store-chunk-tokens", "8",
               "--kv-cache-memory", "480KiB", "--threads", "1"]
    assert main(["kv", "store", "reorder", *options]) == 0
    assert capsys.readouterr().out.startswith("reordered 1 of the 1 nodes with recorded importance")
    assert len(engine(tiny_llama, tmp_path).kv_store.store.stored_keys("m.")) == 1  # the node's map
    assert main(["kv", "store", "reorder", *options]) == 0  # no load since: nothing new to sort by
    assert capsys.readouterr().out.startswith("reordered 0 of the 1 nodes")
    assert main(["kv", "store", "reorder", "--model", str(tiny_llama)]) == 2
    assert "kvstrata kv store reorder needs the store: --kv-store" in capsys.readouterr().err


def test_the_reorder_period_is_checked(tiny_llama):
    with pytest.raises(KvstrataError, match="impress_reorder_seconds"):
        EngineConfig(model=str(tiny_llama), impress_reorder_seconds=-1)


def test_a_pass_leaves_another_model_s_records_in_a_shared_tier_alone(node):
    store, keys, _, _ = node
    other = TieredStore(store.tiers, store.forms, StoreShape("another model/", LAYERS, KV_HEADS, DIM),
                        probe_kv_heads=1)
    record_importance(other, "theirs", keys, torch.rand(LAYERS, TOKENS))
    assert reorder_all(store, CHUNK) == 0
    assert store.stored_keys("s.") == {importance_key("theirs")}
