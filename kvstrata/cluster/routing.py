"""Which replica serves a request: by prefix (consistent hashing with bounded load), round-robin, least-loaded.

Every policy answers with an order over the replicas: the first is the choice, the rest are where a
request goes if that replica dies under it. Replicas marked down come last, so a request is only
sent to one when no other is up.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math

from kvstrata.errors import KvstrataError
from kvstrata.kv.block_hash import chained_block_hash, full_block_hashes

POLICIES = ("prefix", "round-robin", "least-loaded")
VIRTUAL_NODES = 64  # points per replica on the hash ring: spreads keys evenly over few replicas
LOAD_FACTOR = 1.25  # bounded load: no replica takes more than 1.25x the mean of requests in flight


def routing_key(token_ids: list[int], block_size: int, max_tokens: int) -> bytes:
    """The chained hash of the prompt's first full blocks, up to `max_tokens` tokens: the same key for
    prompts that share that much of a prefix, so they meet the same replica's prefix cache. A prompt
    shorter than one block is hashed whole."""
    blocks = full_block_hashes(token_ids[:max_tokens], block_size, [])
    return blocks[-1] if blocks else chained_block_hash(None, token_ids)


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Routing:
    """Base of the policies: `order` sorts the replicas for one request."""

    def __init__(self, num_replicas: int):
        if num_replicas < 1:
            raise KvstrataError(f"a routing policy needs at least one replica, got {num_replicas}")
        self.num_replicas = num_replicas

    def order(self, key: bytes | None, loads: list[int], up: list[bool]) -> list[int]:
        preferred = self.preference(key, loads, up)
        return [i for i in preferred if up[i]] + [i for i in preferred if not up[i]]

    def preference(self, key: bytes | None, loads: list[int], up: list[bool]) -> list[int]:
        raise NotImplementedError


class RoundRobinRouting(Routing):
    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self._next = itertools.count()

    def preference(self, key, loads, up):
        first = next(self._next) % self.num_replicas
        return [(first + i) % self.num_replicas for i in range(self.num_replicas)]


class LeastLoadedRouting(RoundRobinRouting):
    """Fewest requests in flight first; ties go round-robin, so an idle cluster still spreads its work."""

    def preference(self, key, loads, up):
        rotation = super().preference(key, loads, up)
        return sorted(rotation, key=lambda i: loads[i])  # sorted() is stable: ties keep the rotation


class PrefixRouting(Routing):
    """Consistent hashing of the routing key onto a ring of replicas, with bounded load (Mirrokni, Thorup
    and Zadimoghaddam): walking the ring from the key, the first replica that is up and under
    ceil(LOAD_FACTOR x mean load) takes the request. Adding or losing a replica moves only its own keys."""

    def __init__(self, num_replicas: int, virtual_nodes: int = VIRTUAL_NODES, load_factor: float = LOAD_FACTOR):
        super().__init__(num_replicas)
        if load_factor < 1:
            raise KvstrataError(f"the load factor must be at least 1, got {load_factor}")
        self.load_factor = load_factor
        ring = sorted((_point(f"{replica}/{v}".encode()), replica)
                      for replica in range(num_replicas) for v in range(virtual_nodes))
        self._points = [point for point, _ in ring]
        self._owners = [replica for _, replica in ring]
        self._least_loaded = LeastLoadedRouting(num_replicas)

    def ring_order(self, key: bytes) -> list[int]:
        """The replicas in the order the ring meets them, walking clockwise from the key."""
        start = bisect.bisect(self._points, _point(key))
        seen: dict[int, None] = {}
        for step in range(len(self._owners)):
            seen.setdefault(self._owners[(start + step) % len(self._owners)])
            if len(seen) == self.num_replicas:
                break
        return list(seen)

    def preference(self, key, loads, up):
        if key is None:  # nothing to route on (a body the replica will refuse anyway)
            return self._least_loaded.preference(key, loads, up)
        ring = self.ring_order(key)
        live = max(1, sum(up))
        capacity = math.ceil(self.load_factor * (sum(loads[i] for i in ring if up[i]) + 1) / live)
        chosen = next((i for i in ring if up[i] and loads[i] < capacity), ring[0])
        return [chosen] + [i for i in ring if i != chosen]


def make_routing(policy: str, num_replicas: int) -> Routing:
    if policy == "prefix":
        return PrefixRouting(num_replicas)
    if policy == "round-robin":
        return RoundRobinRouting(num_replicas)
    if policy == "least-loaded":
        return LeastLoadedRouting(num_replicas)
    raise KvstrataError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
