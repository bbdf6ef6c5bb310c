"""SIMULATED prefix-cache hit rates of replicas behind the cluster's routing policies (no engine runs).

    .venv/bin/python -m benchmarks.routing_simulation [--out PATH] [--requests N] [--replicas 8,16,32,64]

A seeded synthetic trace (shared prefixes with Zipf popularity, each followed by a unique question, plus
requests that share nothing) arrives as a Poisson process at a cluster of N replicas. Each request is routed
by the real policies of `kvstrata/cluster/routing.py` (`make_routing`, `prompt_blocks`, `Routing.order` and `served` over
the replicas' requests in flight), then served by a discrete-event model of its replica: a prefix cache
(LRU over 16-token blocks, a fixed token capacity per replica), a FIFO prefill queue whose service time is
proportional to the tokens computed, and a decode phase that keeps the request in flight. Optionally every
replica also shares one remote KV tier (Redis-like, capacity not binding) that holds 256-token chunks once
any replica computed them. Every time in the output is MODELED from the cost parameters below, and every hit
rate is SIMULATED: nothing here was measured on hardware. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

import numpy as np

from kvstrata.cluster.routing import POLICIES, KVAwareRouting, PrefixRouting, Routing, make_routing, prompt_blocks
from kvstrata.kv.kv_events import KVEvents

# ---- Modeled costs: one replica = one GPU serving a Llama-3.1-8B-class model (assumptions, not measurements) ----
MODEL_PARAMETERS = 8.03e9  # Llama-3.1-8B
EFFECTIVE_PREFILL_FLOPS = 400e12  # bf16 prefill throughput an H100 might sustain (assumed, ~40% of its dense peak)
# Recomputing one prompt token: ~2 x parameters FLOPs (attention's extra work on long prompts left out).
RECOMPUTE_S_PER_TOKEN = 2 * MODEL_PARAMETERS / EFFECTIVE_PREFILL_FLOPS  # = 40 us
CACHED_S_PER_TOKEN = 1e-6  # a token found in the replica's own prefix cache: read by attention, never recomputed
REQUEST_OVERHEAD_S = 2e-3  # per request on its replica: scheduling, the last prompt token, the first sample
# The shared remote tier: KV shipped as a CacheGen-like bitstream of ~2.3 bits per value.
KV_VALUES_PER_TOKEN = 32 * 8 * 128 * 2  # layers x KV heads x head dim x (K and V) of Llama-3.1-8B
FETCH_BITS_PER_VALUE = 2.3
FETCH_BYTES_PER_TOKEN = KV_VALUES_PER_TOKEN * FETCH_BITS_PER_VALUE / 8  # = 18,842 bytes
FETCH_LINK_BYTES_PER_S = 100e9 / 8  # 100 GbE from the tier to each replica (each replica has its own link)
FETCH_ROUND_TRIP_S = 1e-3  # per fetch: lookup and first byte
FETCH_DECODE_S_PER_TOKEN = 2e-6  # decoding the bitstream on the replica's GPU (occupies the replica)
# Decoding: runs batched beside prefills, so it costs no prefill time here; it only keeps a request in flight
# (the `loads` the policies see) for output tokens x this time per output token.
TIME_PER_OUTPUT_TOKEN_S = 0.025

# ---- Cluster shape ----
BLOCK_SIZE = 16  # tokens per KV block (the engine's default --block-size)
ROUTING_TOKENS = 256  # an unseen prompt's consistent-hashing key covers its first 256 tokens
# Only a prompt's first 256 tokens are hashed here: the trace's prefixes differ from their first block on,
# so deeper blocks would change no routing decision, only slow the simulation.
STORE_CHUNK_TOKENS = 256  # the KV store's unit (--kv-store-chunk-tokens)
VOCAB = 49152  # synthetic token ids are drawn below this


@dataclass(frozen=True)
class Workload:
    requests: int = 50_000
    prefixes: int = 2_000  # shared documents / system prompts
    prefix_tokens: tuple[int, int] = (1_000, 4_000)  # uniform, inclusive
    zipf_s: float = 1.1  # popularity of the prefixes: the k-th most popular is asked with weight k^-s
    suffix_tokens: tuple[int, int] = (50, 200)  # the unique question after a shared prefix
    unique_share: float = 0.2  # requests that share no prefix with any other
    unique_tokens: tuple[int, int] = (100, 2_000)
    output_tokens: tuple[int, int] = (32, 256)
    # Arrival rate, as the share of the cluster's prefill capacity it would take if no prompt token were ever
    # cached: 1.1 overloads a cluster without prefix caching and leaves one with round-robin's hit rate about
    # 70% busy (each configuration reports its modeled busy share).
    offered_load: float = 1.1
    cache_share: float = 0.015  # each replica's prefix cache holds this share of all distinct prefix tokens
    warmup_share: float = 0.2  # the first requests fill the caches and are left out of the figures
    fronts: int = 1  # routers in front of the replicas, taking requests in turn; each sees only its own traffic
    seed: int = 0


@dataclass
class Trace:
    workload: Workload
    prefix_of: np.ndarray  # per request: its prefix, or -1
    prompt_len: np.ndarray
    shared_blocks: np.ndarray  # full blocks inside the shared prefix (0 for a unique request)
    shared_chunks: np.ndarray  # full store chunks inside the shared prefix
    output_len: np.ndarray
    gaps: np.ndarray  # inter-arrival gaps at rate 1 (scaled per cluster size)
    blocks: list[list[bytes]] = field(repr=False)  # each prompt's first block hashes, as the front computes them
    distinct_prefix_tokens: int = 0
    mean_full_service_s: float = 0.0


def make_trace(w: Workload) -> Trace:
    rng = np.random.default_rng(w.seed)
    prefix_len = rng.integers(w.prefix_tokens[0], w.prefix_tokens[1] + 1, w.prefixes)
    popularity = np.arange(1, w.prefixes + 1, dtype=np.float64) ** -w.zipf_s
    popularity /= popularity.sum()
    prefix_head = rng.integers(0, VOCAB, (w.prefixes, ROUTING_TOKENS))  # only the routing key reads tokens

    unique = rng.random(w.requests) < w.unique_share
    prefix_of = np.where(unique, -1, rng.choice(w.prefixes, w.requests, p=popularity))
    suffix = rng.integers(w.suffix_tokens[0], w.suffix_tokens[1] + 1, w.requests)
    unique_len = rng.integers(w.unique_tokens[0], w.unique_tokens[1] + 1, w.requests)
    own_prefix_len = np.where(unique, 0, prefix_len[np.maximum(prefix_of, 0)])
    prompt_len = np.where(unique, unique_len, own_prefix_len + suffix)
    output_len = rng.integers(w.output_tokens[0], w.output_tokens[1] + 1, w.requests)
    gaps = rng.exponential(1.0, w.requests)

    # The block hashes the front routes each prompt on. A shared request's first 256 tokens are its
    # prefix's, hashed once per prefix; a unique request's come from its own (random) first tokens.
    prefix_blocks: dict[int, list[bytes]] = {}
    blocks = []
    for i in range(w.requests):
        p = int(prefix_of[i])
        if p >= 0:
            if p not in prefix_blocks:
                prefix_blocks[p] = prompt_blocks(prefix_head[p].tolist(), BLOCK_SIZE)
            blocks.append(prefix_blocks[p])
        else:
            head = rng.integers(0, VOCAB, min(int(prompt_len[i]), ROUTING_TOKENS)).tolist()
            blocks.append(prompt_blocks(head, BLOCK_SIZE))

    full_service = REQUEST_OVERHEAD_S + prompt_len * RECOMPUTE_S_PER_TOKEN
    return Trace(w, prefix_of.astype(np.int64), prompt_len.astype(np.int64), own_prefix_len // BLOCK_SIZE,
                 own_prefix_len // STORE_CHUNK_TOKENS, output_len, gaps, blocks,
                 distinct_prefix_tokens=int(prefix_len.sum()), mean_full_service_s=float(full_service.mean()))


class BlockLRU:
    """A replica's prefix cache, LRU over blocks. A prompt's blocks are touched together, so the cache keeps
    one entry per prefix (how many of its leading blocks it holds) and one per request for its unique blocks;
    room is made from the least recently used entry, its last blocks first (what block-level LRU evicting a
    request's blocks tail first does). `on_change` is told (entry, blocks held before, blocks held now): the
    replica's KV events."""

    def __init__(self, capacity_blocks: int, on_change=None):
        self.capacity = capacity_blocks
        self.used = 0
        self.entries: OrderedDict[int, int] = OrderedDict()
        self.on_change = on_change

    def held(self, entry: int) -> int:
        return self.entries.get(entry, 0)

    def touch(self, entry: int, blocks: int) -> None:
        blocks = min(blocks, self.capacity)
        old = self.entries.get(entry, 0)
        if blocks > old:
            self.entries[entry] = blocks
            self.used += blocks - old
            self._changed(entry, old, blocks)
        if old:
            self.entries.move_to_end(entry)
        while self.used > self.capacity:
            oldest, count = next(iter(self.entries.items()))
            drop = min(count, self.used - self.capacity)
            self.used -= drop
            if drop == count:
                del self.entries[oldest]
            else:
                self.entries[oldest] = count - drop
            self._changed(oldest, count, count - drop)

    def _changed(self, entry: int, old: int, new: int) -> None:
        if self.on_change is not None:
            self.on_change(entry, old, new)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# Not a policy of the cluster: prefix routing with its load bound lifted, to show what the bound buys.
UNBOUNDED = "prefix-unbounded"


def make_policy(policy: str, replicas: int) -> Routing:
    if policy == UNBOUNDED:
        return PrefixRouting(replicas, load_factor=1e12)
    return make_routing(policy, replicas)


def kv_events(trace: Trace, fronts: list[Routing], replica: int):
    """Under kv-aware routing, a replica cache's changes as the KV events every front reads, applied at once (the
    engine's front polls every 0.5 s). Only shared prefixes' routing blocks are reported: a unique request's
    blocks are never asked for again."""
    if not isinstance(fronts[0], KVAwareRouting):
        return None
    blocks_of_prefix = {int(p): trace.blocks[i] for i, p in enumerate(trace.prefix_of) if p >= 0}

    def changed(entry: int, old: int, new: int) -> None:
        if entry < 0:
            return
        blocks = blocks_of_prefix[entry]
        changes = [(True, b) for b in blocks[old:new]] + [(False, b) for b in blocks[new:old]]
        if changes:
            for routing in fronts:
                routing.apply(replica, b"", KVEvents("simulated", 0, changes, snapshot=False))

    return changed


def simulate(trace: Trace, replicas: int, policy: str, shared_tier: bool) -> dict:
    """One configuration; the discrete-event loop. Times are modeled seconds."""
    w = trace.workload
    # Each request reaches one of the fronts, which share nothing but the replicas' events
    fronts = [make_policy(policy, replicas) for _ in range(w.fronts)]
    up = [True] * replicas
    loads = [[0] * replicas for _ in fronts]  # per front, its requests in flight per replica (not yet done decoding)
    capacity_blocks = max(1, int(w.cache_share * trace.distinct_prefix_tokens) // BLOCK_SIZE)
    caches = [BlockLRU(capacity_blocks, kv_events(trace, fronts, r)) for r in range(replicas)]
    queues: list[deque] = [deque() for _ in range(replicas)]
    busy = [False] * replicas
    busy_s = [0.0] * replicas
    served = [0] * replicas
    stored_chunks: dict[int, int] = {}  # the shared tier: per prefix, how many leading chunks it holds
    rate = w.offered_load * replicas / trace.mean_full_service_s
    arrivals = np.cumsum(trace.gaps) / rate
    warmup = int(w.warmup_share * w.requests)

    ttft: list[float] = []
    prompt_tokens = local_hit_tokens = tier_hit_tokens = fetched_bytes = 0
    events: list[tuple] = []  # (time, seq, kind, replica, request, preloaded tokens, fetched tokens)
    seq = 0
    READY, PREFILL_DONE, DONE = 0, 1, 2

    prefix_of, prompt_len, shared_blocks = trace.prefix_of, trace.prompt_len, trace.shared_blocks
    shared_chunks, output_len = trace.shared_chunks, trace.output_len

    def start(r: int, now: float) -> None:
        nonlocal seq, prompt_tokens, local_hit_tokens, tier_hit_tokens
        i, preloaded, fetched = queues[r].popleft()
        busy[r] = True
        p = int(prefix_of[i])
        length = int(prompt_len[i])
        local = min(caches[r].held(p), int(shared_blocks[i])) * BLOCK_SIZE if p >= 0 else 0
        if p >= 0 and local:
            caches[r].touch(p, local // BLOCK_SIZE)  # the hit blocks are used now
        covered = max(local, preloaded)
        service = (REQUEST_OVERHEAD_S + local * CACHED_S_PER_TOKEN + fetched * FETCH_DECODE_S_PER_TOKEN
                   + (length - covered) * RECOMPUTE_S_PER_TOKEN)
        busy_s[r] += service
        if i >= warmup:
            prompt_tokens += length
            local_hit_tokens += local
            tier_hit_tokens += covered - local
        seq += 1
        heapq.heappush(events, (now + service, seq, PREFILL_DONE, r, i, 0, 0))

    def handle(event: tuple) -> None:
        nonlocal seq
        now, _, kind, r, i, preloaded, fetched = event
        if kind == READY:
            queues[r].append((i, preloaded, fetched))
            if not busy[r]:
                start(r, now)
        elif kind == PREFILL_DONE:
            busy[r] = False
            p = int(prefix_of[i])
            full_blocks = int(prompt_len[i]) // BLOCK_SIZE
            if p >= 0:
                caches[r].touch(p, int(shared_blocks[i]))
                if shared_tier and shared_chunks[i] > stored_chunks.get(p, 0):
                    stored_chunks[p] = int(shared_chunks[i])  # write-through: the tier has it from now on
            unique_blocks = full_blocks - (int(shared_blocks[i]) if p >= 0 else 0)
            if unique_blocks:
                caches[r].touch(-1 - i, unique_blocks)  # cached too, never asked for again
            if i >= warmup:
                ttft.append(now - arrivals[i])
                served[r] += 1
            seq += 1
            heapq.heappush(events, (now + int(output_len[i]) * TIME_PER_OUTPUT_TOKEN_S, seq, DONE, r, i, 0, 0))
            if queues[r]:
                start(r, now)
        else:
            front = i % w.fronts
            loads[front][r] -= 1
            routing = fronts[front]
            routing.finished(trace.blocks[i], r)
            if isinstance(routing, KVAwareRouting):  # the events are applied as they happen: all read already
                routing.settle(r, routing.num_finished(r))

    for i in range(w.requests):
        now = float(arrivals[i])
        while events and events[0][0] <= now:
            handle(heapq.heappop(events))
        front = i % w.fronts
        routing = fronts[front]
        r = routing.order(trace.blocks[i], loads[front], up)[0]
        routing.routed(trace.blocks[i], r)
        routing.served(trace.blocks[i], r)
        loads[front][r] += 1
        ready, preloaded, fetched = now, 0, 0
        p = int(prefix_of[i])
        if shared_tier and p >= 0 and stored_chunks.get(p, 0):
            # The engine skips the chunks its device pool holds (as of arrival) and loads the rest.
            local_chunks = min(caches[r].held(p), int(shared_blocks[i])) * BLOCK_SIZE // STORE_CHUNK_TOKENS
            chunks = stored_chunks[p] - local_chunks
            if chunks > 0:
                fetched = chunks * STORE_CHUNK_TOKENS
                preloaded = stored_chunks[p] * STORE_CHUNK_TOKENS
                ready = now + FETCH_ROUND_TRIP_S + fetched * FETCH_BYTES_PER_TOKEN / FETCH_LINK_BYTES_PER_S
                if i >= warmup:
                    fetched_bytes += fetched * FETCH_BYTES_PER_TOKEN
        seq += 1
        heapq.heappush(events, (ready, seq, READY, r, i, preloaded, fetched))
    while events:
        handle(heapq.heappop(events))

    measured_s = float(arrivals[-1] - arrivals[warmup]) if w.requests > warmup + 1 else float("nan")
    mean_served = sum(served) / replicas
    return {
        "replicas": replicas,
        "policy": policy,
        "shared_tier": shared_tier,
        "token_hit_rate": round((local_hit_tokens + tier_hit_tokens) / max(1, prompt_tokens), 4),
        "local_hit_rate": round(local_hit_tokens / max(1, prompt_tokens), 4),
        "tier_hit_rate": round(tier_hit_tokens / max(1, prompt_tokens), 4),
        "modeled_ttft_p50_s": round(percentile(ttft, 50), 4),
        "modeled_ttft_p99_s": round(percentile(ttft, 99), 4),
        "modeled_ttft_mean_s": round(float(np.mean(ttft)), 4) if ttft else float("nan"),
        "load_imbalance": round(max(served) / mean_served, 3) if mean_served else float("nan"),
        "modeled_busy_share_mean": round(sum(busy_s) / replicas / float(arrivals[-1]), 3),
        "modeled_busy_share_max": round(max(busy_s) / float(arrivals[-1]), 3),
        "modeled_tier_read_gbps": round(fetched_bytes * 8 / measured_s / 1e9, 2) if shared_tier else 0.0,
        "requests_measured": len(ttft),
    }


def run(workload: Workload, replica_counts: list[int], policies: tuple[str, ...] = (*POLICIES, UNBOUNDED),
        tiers: tuple[bool, ...] = (False, True)) -> dict:
    began = time.perf_counter()
    trace = make_trace(workload)
    results = [simulate(trace, n, policy, tier) for tier in tiers for n in replica_counts for policy in policies]
    return {
        "benchmark": "routing_simulation",
        "kind": "simulated",
        "note": ("Simulated hit rates; modeled times. Nothing here ran an engine or was measured on hardware: "
                 "routing is kvstrata/cluster/routing.py's real code, the replicas are a queueing and LRU model."),
        "command": "python -m benchmarks.routing_simulation",
        "policies": {"prefix": "the replica that last served the prompt's longest prefix, else consistent hashing; "
                               "bounded load (load factor 1.25)",
                     "kv-aware": "the replica whose cache holds the prompt's longest prefix (its KV events applied at "
                                 "once), else consistent hashing; bounded load (load factor 1.25)",
                     "round-robin": "round-robin", "least-loaded": "fewest requests in flight",
                     UNBOUNDED: "not a cluster policy: prefix routing with the load bound lifted, for comparison"},
        "workload": {**asdict(workload),
                     "distinct_prefix_tokens": trace.distinct_prefix_tokens,
                     "cache_tokens_per_replica": int(workload.cache_share * trace.distinct_prefix_tokens)
                     // BLOCK_SIZE * BLOCK_SIZE,
                     "mean_prompt_tokens": round(float(trace.prompt_len.mean()), 1),
                     "mean_full_prefill_s_modeled": round(trace.mean_full_service_s, 5)},
        "modeled_costs": {
            "recompute_s_per_token": RECOMPUTE_S_PER_TOKEN,
            "recompute_basis": f"2 x {MODEL_PARAMETERS:.3g} parameters / {EFFECTIVE_PREFILL_FLOPS:.3g} FLOP/s",
            "cached_s_per_token": CACHED_S_PER_TOKEN,
            "request_overhead_s": REQUEST_OVERHEAD_S,
            "fetch_bytes_per_token": FETCH_BYTES_PER_TOKEN,
            "fetch_bits_per_value": FETCH_BITS_PER_VALUE,
            "fetch_link_gbit_s": FETCH_LINK_BYTES_PER_S * 8 / 1e9,
            "fetch_round_trip_s": FETCH_ROUND_TRIP_S,
            "fetch_decode_s_per_token": FETCH_DECODE_S_PER_TOKEN,
            "time_per_output_token_s": TIME_PER_OUTPUT_TOKEN_S,
            "block_size": BLOCK_SIZE,
            "routing_tokens": ROUTING_TOKENS,
            "store_chunk_tokens": STORE_CHUNK_TOKENS,
            "shared_tier_capacity": "not binding (holds every chunk written)",
        },
        "results": results,
        "simulation_wall_s": round(time.perf_counter() - began, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=Workload.requests)
    parser.add_argument("--prefixes", type=int, default=Workload.prefixes)
    parser.add_argument("--replicas", default="8,16,32,64", help="comma-separated replica counts")
    parser.add_argument("--seed", type=int, default=Workload.seed)
    parser.add_argument("--fronts", type=int, default=Workload.fronts,
                        help="routers taking the requests in turn, each with its own picture (default: 1)")
    parser.add_argument("--out", help="also write the JSON document here")
    args = parser.parse_args()
    if args.fronts < 1:
        parser.error(f"--fronts must be at least 1, got {args.fronts}")
    workload = Workload(requests=args.requests, prefixes=args.prefixes, seed=args.seed, fronts=args.fronts)
    document = run(workload, [int(n) for n in args.replicas.split(",")])
    text = json.dumps(document, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
