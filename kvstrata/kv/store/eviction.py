"""Which chunks a tier with a byte budget keeps (`--kv-store-eviction`): least recently used (lru, the default),
least frequently used (lfu), or IMPRESS's importance score (score: uses x important share, chunk_heat.py).

lru makes room for every chunk it is given. lfu and score keep one min-heap of their tier's chunks, keyed by
value (then by least recent use among equals): a chunk enters a full tier only if its value beats every chunk
it would displace, the paper's rule ("a chunk whose score beats a tier's minimum replaces it"), so lfu and
score differ only in what they rank by. A chunk used but not admitted stays in the tiers below.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping

from kvstrata.kv.store.chunk_heat import ChunkHeat

EVICTION_POLICIES = ("lru", "lfu", "score")


class EvictionPolicy(ABC):
    """Bookkeeping of one tier's chunks; the tier calls it under its own lock."""

    @abstractmethod
    def add(self, key: str) -> None:
        """Chunk `key` was stored."""

    @abstractmethod
    def touch(self, key: str) -> None:
        """Chunk `key` was read, or its value changed."""

    @abstractmethod
    def discard(self, key: str) -> None:
        """Chunk `key` left the tier."""

    @abstractmethod
    def make_room(self, incoming: str, need: int, sizes: Mapping[str, int]) -> list[str] | None:
        """The chunks to drop so that `need` more bytes fit (taken out of the policy), or None if `incoming` is
        not worth what it would displace (nothing changes)."""

    def beats_minimum(self, key: str) -> bool:
        """Whether chunk `key` would displace the tier's least valued chunk."""
        return True

    def rescore(self) -> None:
        """Every value changed (the heat table aged)."""


class LeastRecentlyUsed(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._order[key] = None

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def discard(self, key: str) -> None:
        self._order.pop(key, None)

    def make_room(self, incoming: str, need: int, sizes: Mapping[str, int]) -> list[str] | None:
        victims, freed = [], 0
        while freed < need and self._order:
            key, _ = self._order.popitem(last=False)
            victims.append(key)
            freed += sizes[key]
        return victims


class LeastValuedFirst(EvictionPolicy):
    """A min-heap of (value, last use, key). A value or use changes by pushing a new entry; an entry that is
    no longer the key's latest is skipped when it surfaces."""

    def __init__(self, value: Callable[[str], float]):
        self.value = value
        self._heap: list[tuple[float, int, str]] = []
        self._latest: dict[str, tuple[float, int]] = {}
        self._clock = itertools.count()

    def add(self, key: str) -> None:
        self._push(key)

    def touch(self, key: str) -> None:
        if key in self._latest:
            self._push(key)

    def _push(self, key: str) -> None:
        entry = (self.value(key), next(self._clock))
        self._latest[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 4 * len(self._latest) + 64:  # drop the stale entries now and then
            self._heap = [(*entry, key) for key, entry in self._latest.items()]
            heapq.heapify(self._heap)

    def discard(self, key: str) -> None:
        self._latest.pop(key, None)

    def _pop_least(self) -> tuple[float, int, str] | None:
        while self._heap:
            value, tick, key = heapq.heappop(self._heap)
            if self._latest.get(key) == (value, tick):
                return value, tick, key
        return None

    def make_room(self, incoming: str, need: int, sizes: Mapping[str, int]) -> list[str] | None:
        worth = self.value(incoming)
        popped, freed = [], 0
        while freed < need:
            least = self._pop_least()
            if least is None:
                break
            popped.append(least)
            freed += sizes[least[2]]
        if popped and popped[-1][0] >= worth:  # not worth what it would displace: put them back
            for entry in popped:
                heapq.heappush(self._heap, entry)
            return None
        for _, _, key in popped:
            del self._latest[key]
        return [key for _, _, key in popped]

    def beats_minimum(self, key: str) -> bool:
        least = self._pop_least()
        if least is None:
            return True
        heapq.heappush(self._heap, least)
        return self.value(key) > least[0]

    def rescore(self) -> None:
        for key in list(self._latest):
            self._latest[key] = (self.value(key), self._latest[key][1])
        self._heap = [(*entry, key) for key, entry in self._latest.items()]
        heapq.heapify(self._heap)


def make_policy(name: str, heat: ChunkHeat) -> EvictionPolicy:
    if name == "lru":
        return LeastRecentlyUsed()
    if name == "lfu":
        return LeastValuedFirst(heat.uses)
    if name == "score":
        return LeastValuedFirst(heat.score)
    raise ValueError(f"eviction policy {name!r} is not one of {', '.join(EVICTION_POLICIES)}")
