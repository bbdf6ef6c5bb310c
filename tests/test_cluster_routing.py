"""Routing policies, the merged metrics page and per-replica settings: no Ray needed."""

import pytest

from kvstrata.cluster.metrics_merge import merge_replica_metrics
from kvstrata.cluster.replica import per_replica_store, replica_config
from kvstrata.cluster.routing import KVAwareRouting, PrefixRouting, make_routing, prompt_blocks
from kvstrata.config import EngineConfig
from kvstrata.errors import KvstrataError
from kvstrata.kv.kv_events import KVEvents
from kvstrata.server.metrics import ServerMetrics


def keys(count: int) -> list[list[bytes]]:
    return [prompt_blocks([i] * 40, 16) for i in range(count)]


def test_unseen_prompts_hash_only_their_first_tokens():
    routing, idle, up = PrefixRouting(8, key_tokens=256), [0] * 8, [True] * 8
    shared = list(range(300))
    homes = {routing.order(prompt_blocks(shared + list(range(1000, 1000 + n)), 16), idle, up)[0] for n in range(20)}
    assert len(homes) == 1  # questions on one 300-token document: one replica
    # A prompt shorter than one block still has a key of its own.
    assert prompt_blocks([1, 2], 16) != prompt_blocks([1, 3], 16)


def test_a_conversation_follows_the_replica_that_served_its_last_turn():
    routing, idle, up = PrefixRouting(8), [0] * 8, [True] * 8
    turn = list(range(40))  # shorter than the 256-token key: each turn alone would hash differently
    first = routing.order(prompt_blocks(turn, 16), idle, up)[0]
    routing.served(prompt_blocks(turn, 16), first)
    for step in range(10):
        turn = turn + list(range(100 * step, 100 * step + 30))
        assert routing.order(prompt_blocks(turn, 16), idle, up)[0] == first
        routing.served(prompt_blocks(turn, 16), first)
    # a hot replica is passed over, even for a remembered prefix
    loads = idle.copy()
    loads[first] = 5
    assert routing.order(prompt_blocks(turn, 16), loads, up)[0] != first


def test_prefix_routing_is_sticky_and_spreads_distinct_prefixes():
    routing = PrefixRouting(4)
    idle, up = [0] * 4, [True] * 4
    chosen = [routing.order(key, idle, up)[0] for key in keys(200)]
    assert chosen == [routing.order(key, idle, up)[0] for key in keys(200)]
    shares = [chosen.count(r) / len(chosen) for r in range(4)]
    assert min(shares) > 0.12, shares  # 64 points per replica keep the ring even


def test_prefix_routing_moves_only_the_lost_replicas_keys():
    routing = PrefixRouting(4)
    idle = [0] * 4
    before = [routing.order(key, idle, [True] * 4)[0] for key in keys(200)]
    after = [routing.order(key, idle, [True, False, True, True])[0] for key in keys(200)]
    assert all(b == a for b, a in zip(before, after) if b != 1)
    assert 1 not in after


def test_bounded_load_diverts_from_a_hot_replica():
    routing = PrefixRouting(2, load_factor=1.25)
    key = keys(1)[0]
    home = routing.order(key, [0, 0], [True, True])[0]
    loads = [0, 0]
    loads[home] = 10
    assert routing.order(key, loads, [True, True])[0] != home
    loads[home] = 1  # within 1.25x the mean: stays home
    assert routing.order(key, loads, [True, True])[0] == home


def stored(blocks: list[bytes]) -> list[tuple[bool, bytes]]:
    return [(True, block) for block in blocks]


def test_kv_aware_routing_goes_where_the_longest_prefix_is_held_now():
    routing, idle, up = KVAwareRouting(3), [0] * 3, [True] * 3
    document = prompt_blocks(list(range(200)), 16)  # 12 blocks
    question = prompt_blocks(list(range(200)) + list(range(500, 540)), 16)
    by_hashing = routing.order(question, idle, up)[0]  # nobody is known to hold anything: the ring, as under prefix
    assert by_hashing == PrefixRouting(3).order(question, idle, up)[0]
    holder, partial = (by_hashing + 1) % 3, (by_hashing + 2) % 3
    routing.apply(holder, b"", KVEvents("log-h", 12, stored(document), snapshot=False))
    routing.apply(partial, b"", KVEvents("log-p", 6, stored(document[:6]), snapshot=False))
    assert routing.order(question, idle, up)[0] == holder  # the whole document beats its first half
    routing.apply(partial, b"", KVEvents("log-p", 12, stored(document[6:]), snapshot=False))
    loads = [2, 2, 2]
    loads[partial] = 1
    assert routing.order(question, loads, up)[0] == partial  # both hold it all: the less loaded
    assert routing.order(question, idle, up)[0] == min(holder, partial, key=routing.ring_order(question[-1]).index)
    routing.apply(partial, b"", KVEvents("log-p", 13, [(False, document[3])], snapshot=False))  # evicted
    assert routing.order(question, loads, up)[0] == holder
    loads[holder] = 9  # at the load bound: passed over, for the next shorter match
    assert routing.order(question, loads, up)[0] == partial
    assert routing.cursors[partial] == ("log-p", 13)


def test_under_a_sliding_window_a_document_whose_head_was_handed_out_is_still_reused_where_it_is_held():
    """A window gives a document's head back to its replica's pool first: the replica still reuses the document
    (its prefix cache matches where the blocks the next query reads are), and the front counts it so."""
    routing, idle, up = KVAwareRouting(3, 16, 64), [0] * 3, [True] * 3
    document = prompt_blocks(list(range(200)), 16)  # 12 blocks
    question = prompt_blocks(list(range(200)) + list(range(500, 540)), 16)
    by_hashing = routing.order(question, idle, up)[0]
    holder, head_only = (by_hashing + 1) % 3, (by_hashing + 2) % 3
    routing.apply(holder, b"", KVEvents("log-h", 8, stored(document[4:]), snapshot=False))  # its first 4 reused
    routing.apply(head_only, b"", KVEvents("log-p", 3, stored(document[:3]), snapshot=False))
    assert routing.order(question, idle, up)[0] == head_only  # no window: every query reads the head
    routing.apply(holder, b"", KVEvents("log-h", 8, [], snapshot=False), window=64)
    assert routing.window == 64
    # a query after the 12 blocks reads the last 4 (64 tokens): the holder can reuse 12 blocks, the other 3
    assert routing.order(question, idle, up)[0] == holder
    routing.apply(holder, b"", KVEvents("log-h", 9, [(False, document[9])], snapshot=False), window=64)
    # now a gap at block 9: the holder reuses blocks up to 9 (5 to 8 read by the query after them), still more
    assert routing.order(question, idle, up)[0] == holder
    routing.apply(holder, b"", KVEvents("log-h", 10, [(False, document[6])], snapshot=False), window=64)
    assert routing.order(question, idle, up)[0] == head_only  # runs of 2 blocks: no query finds its 4 held


def test_kv_aware_routing_starts_over_from_a_snapshot_and_forgets_a_failed_replica():
    routing, idle, up = KVAwareRouting(2), [0, 0], [True, True]
    first, second = prompt_blocks(list(range(64)), 16), prompt_blocks(list(range(100, 164)), 16)
    home = 1 - routing.order(first, idle, up)[0]  # not where hashing alone would send it
    routing.apply(home, b"ns/", KVEvents("log", 4, stored(first), snapshot=False))
    assert routing.namespace == b"ns/"  # the front hashes prompts in the replicas' namespace from now on
    assert routing.order(first, idle, up)[0] == home
    routing.apply(home, b"ns/", KVEvents("restarted", 4, stored(second), snapshot=True))  # replaces what was known
    assert routing.order(first, idle, up)[0] == 1 - home
    routing.forget(home)
    assert routing.cursors[home] == (None, 0) and routing.order(second, idle, up) == routing.ring_order(second[-1])
    routing.served(second, home)  # no memory of its own: only the replicas' events say who holds what
    assert routing.order(second, idle, up) == routing.ring_order(second[-1])


def test_kv_aware_routing_counts_a_prompt_as_held_where_it_is_in_flight_until_its_events_were_read():
    routing, idle, up = KVAwareRouting(2), [0, 0], [True, True]
    passage = prompt_blocks(list(range(64)), 16)
    elsewhere = 1 - routing.order(passage, idle, up)[0]
    routing.routed(passage, elsewhere)  # sent there (the bounded load, say); nothing computed yet
    assert routing.order(passage, idle, up)[0] == elsewhere  # the next question queues behind it, not beside
    routing.apply(elsewhere, b"", KVEvents("log", 1, [(False, passage[0])], snapshot=False))  # an old copy's eviction
    routing.apply(elsewhere, b"", KVEvents("restarted", 0, [], snapshot=True))
    assert routing.order(passage, idle, up)[0] == elsewhere  # neither cancels a request still in flight
    routing.finished(passage, elsewhere)
    finished = routing.num_finished(elsewhere)
    assert routing.order(passage, idle, up)[0] == elsewhere  # ended, but its events may not have been read yet
    routing.apply(elsewhere, b"", KVEvents("restarted", 4, stored(passage[:2]), snapshot=False))
    routing.settle(elsewhere, finished)
    assert routing.num_finished(elsewhere) == 0
    assert routing.order(passage, idle, up)[0] == elsewhere  # what it reported holding still counts...
    question = prompt_blocks(list(range(64)) + list(range(300, 340)), 16)
    routing.apply(1 - elsewhere, b"", KVEvents("other", 6, stored(question), snapshot=False))
    assert routing.order(question, idle, up)[0] == 1 - elsewhere  # ...against a replica holding more of the prompt

    another = prompt_blocks(list(range(500, 564)), 16)
    away = 1 - routing.order(another, idle, up)[0]
    routing.routed(another, away)
    routing.forget(away)  # marked down: what it reported is gone...
    assert routing.num_held(away) == 0
    assert routing.order(another, idle, up)[0] == away  # ...but the request sent before it still ends there
    routing.finished(another, away)
    routing.settle(away, routing.num_finished(away))
    assert routing.order(another, idle, up)[0] == 1 - away


def test_round_robin_and_least_loaded():
    rr = make_routing("round-robin", 3)
    assert [rr.order(None, [0] * 3, [True] * 3)[0] for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    least = make_routing("least-loaded", 3)
    assert least.order(None, [4, 1, 2], [True] * 3) == [1, 2, 0]
    assert least.order(None, [4, 1, 2], [True, False, True]) == [2, 0, 1]  # a replica that is down comes last


def test_bad_policy_and_sizes_are_refused():
    with pytest.raises(KvstrataError, match="'sticky' is not one of prefix, kv-aware, round-robin, least-loaded"):
        make_routing("sticky", 2)
    with pytest.raises(KvstrataError, match="at least one replica"):
        make_routing("prefix", 0)


def test_merged_metrics_label_each_replica_and_add_them_up():
    pages = {}
    for replica, (tokens, usage) in enumerate([(5, 0.2), (7, 0.4)]):
        metrics = ServerMetrics("m")
        metrics.generation_tokens.inc(tokens)
        metrics.kv_usage.set(usage)
        metrics.ttft.observe(0.3 * (replica + 1))
        pages[replica] = metrics.render().decode()
    text = merge_replica_metrics(pages).decode()
    assert 'kvstrata:generation_tokens_total{model_name="m",replica="1"} 7.0' in text
    assert 'kvstrata:generation_tokens_total{model_name="m"} 12.0' in text
    assert 'kvstrata:kv_cache_usage_perc{model_name="m"} 0.3' in text  # a fraction: the mean
    assert 'kvstrata:time_to_first_token_seconds_count{model_name="m"} 2.0' in text
    assert text.count("# TYPE kvstrata:generation_tokens_total counter") == 1


def test_replicas_get_their_own_disk_directory_and_a_share_of_the_cores():
    spec = "host:1GiB,disk:/var/cache/kvstrata:20GiB,redis://127.0.0.1:6379"
    assert per_replica_store(spec, 1) == "host:1GiB,disk:/var/cache/kvstrata/replica-1:20GiB,redis://127.0.0.1:6379"
    assert per_replica_store(None, 0) is None
    config = replica_config(EngineConfig(model="m", kv_store=spec), 0, 2)
    assert config.threads >= 1 and config.kv_store.count("replica-0") == 1
    assert replica_config(EngineConfig(model="m", threads=3), 0, 2).threads == 3


@pytest.mark.parametrize("flags, message", [
    (["--routing", "round-robin"], "--routing applies to replicated serving only; add --replicas N"),
    (["--ray-address", "auto"], "--ray-address applies to replicated serving only"),
    (["--fronts", "2"], "--fronts applies to replicated serving only"),
    (["--replicas", "2", "--fronts", "0"], "--fronts must be at least 1, got 0"),
    (["--replicas", "0"], "--replicas must be at least 1, got 0"),
    (["--replicas", "2", "--allow-runtime-lora-updating"], "--allow-runtime-lora-updating serves one process"),
    (["--replicas", "2", "--routing", "kv-aware", "--no-enable-prefix-caching"], "--routing kv-aware follows"),
    (["--replicas", "2", "--routing", "kv-aware", "--kv-offload", "h2o"], "--routing kv-aware follows"),
])
def test_serve_refuses_cluster_flags_that_do_not_fit(flags, message, capsys):
    from kvstrata.cli.main import main

    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_remembered_prefixes_are_bounded():
    routing = PrefixRouting(2, memory_blocks=4)
    routing.served(prompt_blocks(list(range(160)), 16), 1)  # ten blocks: the oldest six are forgotten
    assert len(routing._memory) == 4


def test_a_failed_replica_is_forgotten():
    routing = PrefixRouting(4)
    routing.served(prompt_blocks(list(range(64)), 16), 2)
    routing.served(prompt_blocks(list(range(100, 164)), 16), 1)
    routing.forget(2)  # it comes back with an empty cache
    assert set(routing._memory.values()) == {1}


def test_replicas_without_ray_say_how_to_install_it(monkeypatch):
    import sys

    from kvstrata.cluster.launch import deploy
    from kvstrata.server.options import ServerOptions

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the cluster extra were not installed
    with pytest.raises(KvstrataError, match=r"pip install 'kvstrata\[cluster\]'"):
        deploy(EngineConfig(model="m"), ServerOptions(), 2, "prefix", "127.0.0.1", 8000)


def test_merged_info_gauges_keep_the_latest_reading():
    page = ('# HELP kvstrata:lora_requests_info LoRA adapters\n# TYPE kvstrata:lora_requests_info gauge\n'
            'kvstrata:lora_requests_info{max_lora="",running_lora_adapters="sql",waiting_lora_adapters=""} {}\n')
    text = merge_replica_metrics({0: page.replace("{}", "100.0"), 1: page.replace("{}", "250.0")}).decode()
    assert ('kvstrata:lora_requests_info{max_lora="",running_lora_adapters="sql",waiting_lora_adapters=""} 250.0'
            in text)
