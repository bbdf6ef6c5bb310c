"""The simulated routing benchmark (benchmarks/routing_simulation.py) on a tiny configuration."""

from benchmarks.routing_simulation import UNBOUNDED, Workload, run
from kvstrata.cluster.routing import POLICIES


def test_prefix_routing_beats_round_robin_on_shared_prefixes():
    workload = Workload(requests=3_000, prefixes=200, seed=3)
    document = run(workload, [8, 16])
    assert document["kind"] == "simulated"
    results = document["results"]

    configurations = {(r["replicas"], r["shared_tier"]) for r in results}
    assert configurations == {(8, False), (8, True), (16, False), (16, True)}
    for replicas, tier in configurations:
        policies = [r["policy"] for r in results if (r["replicas"], r["shared_tier"]) == (replicas, tier)]
        assert sorted(policies) == sorted((*POLICIES, UNBOUNDED))

    by = {(r["replicas"], r["policy"], r["shared_tier"]): r for r in results}
    for r in results:
        assert 0 <= r["local_hit_rate"] <= r["token_hit_rate"] <= 1
        assert abs(r["local_hit_rate"] + r["tier_hit_rate"] - r["token_hit_rate"]) < 1e-3
        assert r["modeled_ttft_p50_s"] <= r["modeled_ttft_p99_s"]
        assert r["requests_measured"] == 3_000 - int(workload.warmup_share * 3_000)
        if not r["shared_tier"]:
            assert r["tier_hit_rate"] == 0 and r["modeled_tier_read_gbps"] == 0
    # Affinity: prefix routing sends a prefix's requests to the replica that holds it.
    assert by[(8, "prefix", False)]["token_hit_rate"] > by[(8, "round-robin", False)]["token_hit_rate"] + 0.05
    # Round-robin spreads requests evenly; the load bound keeps prefix routing nearer even than without it.
    assert by[(8, "round-robin", False)]["load_imbalance"] <= 1.01
    assert by[(16, "prefix", False)]["load_imbalance"] < by[(16, UNBOUNDED, False)]["load_imbalance"]
    # A shared tier only adds hits, and round-robin needs more of it than prefix routing does.
    for policy in POLICIES:
        assert by[(8, policy, True)]["token_hit_rate"] >= by[(8, policy, False)]["token_hit_rate"]
    assert by[(8, "round-robin", True)]["tier_hit_rate"] > by[(8, "prefix", True)]["tier_hit_rate"]


def test_kv_aware_fronts_share_the_replicas_events_where_prefix_fronts_each_remember_a_part():
    workload = Workload(requests=3_000, prefixes=200, seed=3, fronts=4)
    by = {r["policy"]: r for r in run(workload, [8], policies=("prefix", "kv-aware"), tiers=(False,))["results"]}
    assert by["kv-aware"]["token_hit_rate"] > by["prefix"]["token_hit_rate"]
    assert by["kv-aware"]["requests_measured"] == 3_000 - int(workload.warmup_share * 3_000)
