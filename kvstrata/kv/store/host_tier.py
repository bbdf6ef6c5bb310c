"""Chunks in host memory, within a byte budget; which chunks stay when it is full is the eviction policy's choice
(eviction.py; least recently used by default)."""

from __future__ import annotations

import threading

from kvstrata.kv.store.eviction import EvictionPolicy, LeastRecentlyUsed
from kvstrata.kv.store.tier import Objects, Tier, TierUsage


class HostTier(Tier):
    name = "host"

    def __init__(self, capacity: int, policy: EvictionPolicy | None = None):
        super().__init__()
        self.capacity = capacity
        self.policy = policy or LeastRecentlyUsed()
        self._chunks: dict[str, Objects] = {}
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._chunks

    def get(self, key: str, names: list[str] | None) -> Objects | None:
        with self._lock:
            objects = self._chunks.get(key)
            names = list(objects or ()) if names is None else names
            if objects is None or any(name not in objects for name in names):
                return None
            self.policy.touch(key)
            return {name: objects[name] for name in names}

    def put(self, key: str, objects: Objects) -> bool:
        size = sum(len(data) for data in objects.values())
        if size > self.capacity:
            return False
        with self._lock:
            if key in self._chunks:
                return True
            victims = self.policy.make_room(key, self._bytes + size - self.capacity, self._sizes)
            if victims is None:
                self.stats.chunks_refused += 1
                return False
            evicted = [(old_key, self._pop(old_key)) for old_key in victims]
            self._chunks[key] = dict(objects)
            self._sizes[key] = size
            self._bytes += size
            self.policy.add(key)
        self.stats.chunks_evicted += len(evicted)
        for old_key, old in evicted:
            if self.on_evict is not None:
                self.on_evict(old_key, lambda old=old: old)
        return True

    def _pop(self, key: str) -> Objects:
        self._bytes -= self._sizes.pop(key)
        return self._chunks.pop(key)

    def used(self, key: str) -> None:
        with self._lock:
            self.policy.touch(key)

    def would_keep(self, key: str) -> bool:
        with self._lock:
            mean_size = self._bytes / len(self._chunks) if self._chunks else 0
            return self.capacity - self._bytes >= mean_size or self.policy.beats_minimum(key)

    def rescore(self) -> None:
        with self._lock:
            self.policy.rescore()

    def remove(self, key: str) -> None:
        with self._lock:
            if key in self._chunks:
                self._pop(key)
                self.policy.discard(key)

    def stored_keys(self) -> list[str]:
        with self._lock:
            return list(self._chunks)

    def clear(self) -> None:
        with self._lock:
            for key in self._chunks:
                self.policy.discard(key)
            self._chunks.clear()
            self._sizes.clear()
            self._bytes = 0

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._chunks), self._bytes, self.capacity)

    def describe(self) -> str:
        return f"host:{self.capacity}"
