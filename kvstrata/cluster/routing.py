"""Which replica serves a request: by prefix (remembered prefixes, else consistent hashing, with bounded
load), by the replicas' reports of what their caches hold (kv-aware), round-robin, least-loaded.

A request is described by the chained hashes of its prompt's full blocks (the prefix cache's own keys; under
kv-aware routing in the replicas' namespace, so they are the very keys the replicas report, elsewhere
without it). Every policy answers with an order over the replicas: the first is the choice, the rest are
where a request goes if that replica dies under it.
Replicas marked down come last (the front skips them: Serve would hold a request for a dead one).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import Counter, OrderedDict

from kvstrata.errors import KvstrataError
from kvstrata.kv.block_hash import BlockHash, chained_block_hash, full_block_hashes, tenant_salt
from kvstrata.kv.kv_events import KVEvents
from kvstrata.kv.window_blocks import longest_readable_prefix

POLICIES = ("prefix", "kv-aware", "round-robin", "least-loaded")
VIRTUAL_NODES = 64  # points per replica on the hash ring: spreads keys evenly over few replicas
LOAD_FACTOR = 1.25  # bounded load: no replica takes more than 1.25x the mean of requests in flight
MATCH_TOKENS = 8192  # how much of a prompt is matched against remembered prefixes
MEMORY_BLOCKS = 500_000  # remembered block hashes (about 50 MB): the front's picture of the replicas' caches


def prompt_blocks(token_ids: list[int], block_size: int, cache_salt: str | None = None,
                  namespace: bytes = b"") -> list[bytes]:
    """Chained hashes of the prompt's full blocks (its first MATCH_TOKENS tokens), in the chain of its namespace and
    cache salt (as the replicas' prefix caches keep them apart); a prompt shorter than one block is hashed whole, so
    it still has a key of its own."""
    root = namespace + (b"" if cache_salt is None else tenant_salt(cache_salt))
    blocks = full_block_hashes(token_ids[:MATCH_TOKENS], block_size, [], root)
    return blocks or [chained_block_hash(root, token_ids)]


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Routing:
    """Base of the policies: `order` sorts the replicas for one request."""

    def __init__(self, num_replicas: int):
        if num_replicas < 1:
            raise KvstrataError(f"a routing policy needs at least one replica, got {num_replicas}")
        self.num_replicas = num_replicas
        self.namespace = b""  # what `prompt_blocks` chains a request's blocks from

    def order(self, blocks: list[bytes] | None, loads: list[int], up: list[bool]) -> list[int]:
        preferred = self.preference(blocks, loads, up)
        return [i for i in preferred if up[i]] + [i for i in preferred if not up[i]]

    def preference(self, blocks: list[bytes] | None, loads: list[int], up: list[bool]) -> list[int]:
        raise NotImplementedError

    def routed(self, blocks: list[bytes] | None, replica: int) -> None:
        """Told that a request is being sent to `replica`; `finished` follows once it ended there, however."""

    def finished(self, blocks: list[bytes] | None, replica: int) -> None:
        """Told that a request sent to `replica` ended (answered, refused, failed or given up)."""

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


class RingRouting(Routing):
    """Consistent hashing of the prompt's first `key_tokens` tokens onto a ring of replicas, so fronts that share
    no memory still agree, unless `holder` names a replica that holds a prefix of the prompt. Either way with
    bounded load (Mirrokni, Thorup and Zadimoghaddam): a replica already at ceil(LOAD_FACTOR x mean load) is
    passed over, for another holder or the next replica on the ring. Adding or losing a replica moves only its
    own keys."""

    def __init__(self, num_replicas: int, block_size: int = 16, key_tokens: int = 256,
                 virtual_nodes: int = VIRTUAL_NODES, load_factor: float = LOAD_FACTOR):
        super().__init__(num_replicas)
        if load_factor < 1:
            raise KvstrataError(f"the load factor must be at least 1, got {load_factor}")
        self.block_size = block_size
        self.key_blocks = max(1, key_tokens // block_size)
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

    def preference(self, blocks, loads, up):
        if not blocks:  # nothing to route on (a body the replica will refuse anyway)
            return self._least_loaded.preference(blocks, loads, up)
        ring = self.ring_order(blocks[min(len(blocks), self.key_blocks) - 1])
        live = max(1, sum(up))
        capacity = math.ceil(self.load_factor * (sum(loads[i] for i in ring if up[i]) + 1) / live)

        def open_(replica: int) -> bool:
            return up[replica] and loads[replica] < capacity

        chosen = self.holder(blocks, ring, open_, loads)
        if chosen is None:
            chosen = next((i for i in ring if open_(i)), ring[0])
        return [chosen] + [i for i in ring if i != chosen]

    def holder(self, blocks: list[bytes], ring: list[int], open_, loads: list[int]) -> int | None:
        """An open replica that holds a prefix of the prompt, or None."""
        raise NotImplementedError


class PrefixRouting(RingRouting):
    """The replica that last served the longest prefix of the prompt the front remembers (a conversation's
    next turn, another question on the same document), else the ring; with bounded load."""

    def __init__(self, num_replicas: int, block_size: int = 16, key_tokens: int = 256,
                 virtual_nodes: int = VIRTUAL_NODES, load_factor: float = LOAD_FACTOR,
                 memory_blocks: int = MEMORY_BLOCKS):
        super().__init__(num_replicas, block_size, key_tokens, virtual_nodes, load_factor)
        self._memory: OrderedDict[bytes, int] = OrderedDict()  # block hash -> replica that last served it
        self._memory_blocks = memory_blocks

    def holder(self, blocks, ring, open_, loads):
        remembered = (self._memory.get(block) for block in reversed(blocks))
        return next((r for r in remembered if r is not None and open_(r)), None)

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


class KVAwareRouting(RingRouting):
    """The replica whose prefix cache holds the longest prefix of the prompt, as the replicas' own KV events
    report it (kv/kv_events.py), rather than where the front last sent such a prompt: a replica that evicted a
    passage is no longer sent its questions, and what other fronts or other traffic put in a cache counts.

    Events come only once a prompt's KV is computed, so a prompt's blocks also count as held on the replica it
    was sent to while the request is in flight, and until the replica's events after its end have been read
    (`routed`, `finished`, `settle`); without that, the questions arriving while the first one on a passage is
    still queued would be spread by hashing and computed twice. Among replicas holding equally much, the less
    loaded, then the ring's order; a prompt nobody holds goes by consistent hashing; bounded load as under
    `prefix`. Under a sliding window (`window`) a prefix counts as held where the blocks its next query reads are,
    as the replicas' prefix caches match it: a replica whose pool handed out a document's head, which the window
    gives back first, still reuses the document."""

    def __init__(self, num_replicas: int, block_size: int = 16, key_tokens: int = 256):
        super().__init__(num_replicas, block_size, key_tokens)
        self.window: int | None = None  # the replicas' sliding window, as their events say
        self._holders: dict[BlockHash, set[int]] = {}  # who holds or is computing each block
        self._held: list[set[BlockHash]] = [set() for _ in range(num_replicas)]  # as the replica reported
        self._in_flight: list[Counter[BlockHash]] = [Counter() for _ in range(num_replicas)]  # requests sent with it
        self._finished: list[list[list[BlockHash]]] = [[] for _ in range(num_replicas)]  # ended, not yet settled
        # where each replica's stream has been read to
        self.cursors: list[tuple[str | None, int]] = [(None, 0)] * num_replicas

    def routed(self, blocks, replica):
        for block in blocks or ():
            self._in_flight[replica][block] += 1
            self._holders.setdefault(block, set()).add(replica)

    def finished(self, blocks, replica):
        """The request sent with `blocks` ended (answered or not): they stop counting once `settle` is called with
        a count taken after this, that is, once events the replica sent after the end were read."""
        self._finished[replica].append(list(blocks or ()))

    def num_finished(self, replica: int) -> int:
        return len(self._finished[replica])

    def settle(self, replica: int, count: int) -> None:
        """The first `count` requests that finished on `replica` stop counting as in flight."""
        in_flight = self._in_flight[replica]
        for blocks in self._finished[replica][:count]:
            for block in blocks:
                in_flight[block] -= 1
                if in_flight[block] <= 0:
                    del in_flight[block]
                    self._release(block, replica)
        del self._finished[replica][:count]

    def apply(self, replica: int, namespace: bytes, events: KVEvents, window: int | None = None) -> None:
        """A replica's news, with the namespace its block hashes are chained from and the sliding window its
        prefix cache matches under."""
        if events.snapshot:  # what was reported before is replaced; requests in flight still count
            self._drop_reported(replica)
        held = self._held[replica]
        # every replica serves one model in one KV form and one configuration: one namespace, one window
        self.namespace, self.window = namespace, window
        for stored, block in events.changes:
            if stored:
                held.add(block)
                self._holders.setdefault(block, set()).add(replica)
            else:
                held.discard(block)
                self._release(block, replica)
        self.cursors[replica] = (events.log_id, events.cursor)

    def num_held(self, replica: int) -> int:
        return len(self._held[replica])

    def _release(self, block: BlockHash, replica: int) -> None:
        """Take `replica` off the block's holders unless it still holds it or a request in flight brings it."""
        if block in self._held[replica] or block in self._in_flight[replica]:
            return
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block]

    def holder(self, blocks, ring, open_, loads):
        def reusable_blocks(replica: int) -> int:  # the longest prefix whose next query finds what it reads
            held = (replica in self._holders.get(block, ()) for block in blocks)
            return longest_readable_prefix(held, self.block_size, self.window)

        reusable = {r: reusable_blocks(r) for r in range(self.num_replicas) if open_(r)}
        most = max(reusable.values(), default=0)
        if most == 0:
            return None
        return min((r for r, n in reusable.items() if n == most), key=lambda r: (loads[r], ring.index(r)))

    def forget(self, replica):
        """What the replica reported is gone with it; its requests in flight still end (`finished`) and settle as
        usual, and while it is down it is not open to be chosen anyway."""
        self._drop_reported(replica)
        self.cursors[replica] = (None, 0)

    def _drop_reported(self, replica: int) -> None:
        old, self._held[replica] = self._held[replica], set()
        for block in old:
            self._release(block, replica)


def make_routing(policy: str, num_replicas: int, block_size: int = 16, key_tokens: int = 256) -> Routing:
    if policy == "prefix":
        return PrefixRouting(num_replicas, block_size, key_tokens)
    if policy == "kv-aware":
        return KVAwareRouting(num_replicas, block_size, key_tokens)
    if policy == "round-robin":
        return RoundRobinRouting(num_replicas)
    if policy == "least-loaded":
        return LeastLoadedRouting(num_replicas)
    raise KvstrataError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
