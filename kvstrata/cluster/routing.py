"""Which replica serves a request: by prefix (remembered prefixes, else consistent hashing, with bounded
load), round-robin, least-loaded.

A request is described by the chained hashes of its prompt's full blocks (the prefix cache's own keys,
without the namespace: every replica serves the same model). Every policy answers with an order over
the replicas: the first is the choice, the rest are where a request goes if that replica dies under it.
Replicas marked down come last (the front skips them: Serve would hold a request for a dead one).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import OrderedDict

from kvstrata.errors import KvstrataError
from kvstrata.kv.block_hash import chained_block_hash, full_block_hashes, tenant_salt

POLICIES = ("prefix", "round-robin", "least-loaded")
VIRTUAL_NODES = 64  # points per replica on the hash ring: spreads keys evenly over few replicas
LOAD_FACTOR = 1.25  # bounded load: no replica takes more than 1.25x the mean of requests in flight
MATCH_TOKENS = 8192  # how much of a prompt is matched against remembered prefixes
MEMORY_BLOCKS = 500_000  # remembered block hashes (about 50 MB): the front's picture of the replicas' caches


def prompt_blocks(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """Chained hashes of the prompt's full blocks (its first MATCH_TOKENS tokens), in the chain of its cache salt
    (as the replicas' prefix caches keep them apart); a prompt shorter than one block is hashed whole, so it still
    has a key of its own."""
    salt = None if cache_salt is None else tenant_salt(cache_salt)
    blocks = full_block_hashes(token_ids[:MATCH_TOKENS], block_size, [], salt)
    return blocks or [chained_block_hash(salt, token_ids)]


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Routing:
    """Base of the policies: `order` sorts the replicas for one request."""

    def __init__(self, num_replicas: int):
        if num_replicas < 1:
            raise KvstrataError(f"a routing policy needs at least one replica, got {num_replicas}")
        self.num_replicas = num_replicas

    def order(self, blocks: list[bytes] | None, loads: list[int], up: list[bool]) -> list[int]:
        preferred = self.preference(blocks, loads, up)
        return [i for i in preferred if up[i]] + [i for i in preferred if not up[i]]

    def preference(self, blocks: list[bytes] | None, loads: list[int], up: list[bool]) -> list[int]:
        raise NotImplementedError

    def served(self, blocks: list[bytes] | None, replica: int) -> None:
        """Told which replica answered a request (its prefix cache now holds the prompt's blocks)."""

    def forget(self, replica: int) -> None:
        """Told that a replica failed: it comes back with an empty cache."""


class RoundRobinRouting(Routing):
    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self._next = itertools.count()

    def preference(self, blocks, loads, up):
        first = next(self._next) % self.num_replicas
        return [(first + i) % self.num_replicas for i in range(self.num_replicas)]


class LeastLoadedRouting(RoundRobinRouting):
    """Fewest requests in flight first; ties go round-robin, so an idle cluster still spreads its work."""

    def preference(self, blocks, loads, up):
        rotation = super().preference(blocks, loads, up)
        return sorted(rotation, key=lambda i: loads[i])  # sorted() is stable: ties keep the rotation


class PrefixRouting(Routing):
    """The replica that last served the longest prefix of the prompt the front remembers (a conversation's
    next turn, another question on the same document); for a prefix never seen, consistent hashing of
    the first `key_tokens` tokens onto a ring of replicas, so fronts that share no memory still agree.
    Either way with bounded load (Mirrokni, Thorup and Zadimoghaddam): a replica already at
    ceil(LOAD_FACTOR x mean load) is passed over for the next shorter match, or the next replica on the
    ring. Adding or losing a replica moves only its own keys."""

    def __init__(self, num_replicas: int, block_size: int = 16, key_tokens: int = 256,
                 virtual_nodes: int = VIRTUAL_NODES, load_factor: float = LOAD_FACTOR,
                 memory_blocks: int = MEMORY_BLOCKS):
        super().__init__(num_replicas)
        if load_factor < 1:
            raise KvstrataError(f"the load factor must be at least 1, got {load_factor}")
        self.key_blocks = max(1, key_tokens // block_size)
        self.load_factor = load_factor
        ring = sorted((_point(f"{replica}/{v}".encode()), replica)
                      for replica in range(num_replicas) for v in range(virtual_nodes))
        self._points = [point for point, _ in ring]
        self._owners = [replica for _, replica in ring]
        self._memory: OrderedDict[bytes, int] = OrderedDict()  # block hash -> replica that last served it
        self._memory_blocks = memory_blocks
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

    def preference(self, blocks, loads, up):
        if not blocks:  # nothing to route on (a body the replica will refuse anyway)
            return self._least_loaded.preference(blocks, loads, up)
        ring = self.ring_order(blocks[min(len(blocks), self.key_blocks) - 1])
        live = max(1, sum(up))
        capacity = math.ceil(self.load_factor * (sum(loads[i] for i in ring if up[i]) + 1) / live)

        def open_(replica: int) -> bool:
            return up[replica] and loads[replica] < capacity

        remembered = (self._memory.get(block) for block in reversed(blocks))
        chosen = next((r for r in remembered if r is not None and open_(r)), None)
        if chosen is None:
            chosen = next((i for i in ring if open_(i)), ring[0])
        return [chosen] + [i for i in ring if i != chosen]

    def served(self, blocks, replica):
        """The replica that served a block last is its home from now on: it holds the block most recently
        used. (Keeping the first replica instead, so that a request the load bound moved does not move its
        prefix, had lower hit rates in benchmarks/routing_simulation.py.)"""
        for block in blocks or ():
            self._memory[block] = replica
            self._memory.move_to_end(block)
        while len(self._memory) > self._memory_blocks:
            self._memory.popitem(last=False)

    def forget(self, replica):
        for block in [b for b, r in self._memory.items() if r == replica]:
            del self._memory[block]


def make_routing(policy: str, num_replicas: int, block_size: int = 16, key_tokens: int = 256) -> Routing:
    if policy == "prefix":
        return PrefixRouting(num_replicas, block_size, key_tokens)
    if policy == "round-robin":
        return RoundRobinRouting(num_replicas)
    if policy == "least-loaded":
        return LeastLoadedRouting(num_replicas)
    raise KvstrataError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
