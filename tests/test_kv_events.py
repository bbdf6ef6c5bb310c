"""The prefix cache's events (kv/kv_events.py): what a kv-aware router learns from a replica is exactly what its
device pool holds, under the keys the router computes itself."""

from kvstrata import LLM, SamplingParams
from kvstrata.cluster.routing import prompt_blocks
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.kv_events import KVEventLog

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def held(log: KVEventLog) -> set[bytes]:
    """What a reader that starts from nothing learns: the snapshot's hashes."""
    events = log.since(None, 0)
    assert events.snapshot
    return {block for stored, block in events.changes if stored}


def test_a_reader_learns_the_very_keys_a_router_computes_and_their_eviction(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory=24 * 16 * 2 * 3 * 2 * 16 * 4, max_model_len=384)  # 24 blocks
    log = llm.engine.kv_manager.pool.events = KVEventLog()
    namespace = llm.engine.kv_manager.namespace
    first = list(range(3, 83))  # 80 tokens: 5 full blocks
    llm.generate([first], GREEDY)
    salted = SamplingParams(max_tokens=4, temperature=0, cache_salt="tenant-a")
    llm.generate([first], salted)
    expected = set(prompt_blocks(first, 16, None, namespace)) | set(prompt_blocks(first, 16, "tenant-a", namespace))
    assert expected <= held(log)
    assert set(prompt_blocks(first, 16, None)).isdisjoint(held(log))  # the namespace is part of the key

    start = log.since(None, 0)  # a reader that is up to date from here on
    llm.generate([[3 + (7 * i) % 300 for i in range(16 * 23)]], GREEDY)  # nearly the whole pool: evicts the first
    news = log.since(start.log_id, start.cursor)
    assert not news.snapshot and news.cursor > start.cursor
    removed = {block for stored, block in news.changes if not stored}
    assert set(prompt_blocks(first, 16, None, namespace)) & removed
    assert held(log) == set(llm.engine.kv_manager.pool.block_of_hash)  # the log's picture is the pool's

    llm.engine.reset_prefix_cache()
    assert held(log) == set()


def test_a_reader_that_fell_behind_or_holds_another_log_s_cursor_gets_a_snapshot():
    log = KVEventLog(kept_events=4)
    for block in (b"a", b"b", b"c"):
        log.stored(block)
    log.removed(b"b")
    news = log.since(log.log_id, 1)
    assert not news.snapshot and news.changes == [(True, b"b"), (True, b"c"), (False, b"b")] and news.cursor == 4
    assert log.since(log.log_id, 4).changes == []
    log.stored(b"d")  # the first change is no longer kept
    behind = log.since(log.log_id, 0)
    assert behind.snapshot and sorted(behind.changes) == [(True, b"a"), (True, b"c"), (True, b"d")]
    assert log.since("a restarted replica's log", 5).snapshot
    assert log.since(log.log_id, 6).snapshot  # a cursor beyond the newest change is not this log's either


def test_the_pool_reports_registration_eviction_and_forgetting_once_each():
    pool = BlockPool(2)
    log = pool.events = KVEventLog()
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"ha")
    pool.register(b, b"ha")  # the same content indexed already: not a second store
    pool.register(b, b"hb")
    pool.release(a)
    pool.release(b)
    pool.allocate()  # evicts ha, the least recently used
    pool.forget(b)
    pool.forget(b)  # no longer indexed: nothing to report
    assert log.since(log.log_id, 0).changes == [(True, b"ha"), (True, b"hb"), (False, b"ha"), (False, b"hb")]
