"""Chunks in host memory, within a byte budget, least recently used dropped first."""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvstrata.kv.store.tier import Objects, Tier, TierUsage


class HostTier(Tier):
    name = "host"

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._chunks: OrderedDict[str, Objects] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._chunks

    def get(self, key: str, names: list[str]) -> Objects | None:
        with self._lock:
            objects = self._chunks.get(key)
            if objects is None or any(name not in objects for name in names):
                return None
            self._chunks.move_to_end(key)
            return {name: objects[name] for name in names}

    def put(self, key: str, objects: Objects) -> None:
        size = sum(len(data) for data in objects.values())
        if size > self.capacity:
            return
        evicted = []
        with self._lock:
            if key in self._chunks:
                return
            while self._bytes + size > self.capacity:
                old_key, old = self._chunks.popitem(last=False)
                self._bytes -= sum(len(data) for data in old.values())
                evicted.append((old_key, old))
            self._chunks[key] = dict(objects)
            self._bytes += size
        self.stats.chunks_evicted += len(evicted)
        for old_key, old in evicted:
            if self.on_evict is not None:
                self.on_evict(old_key, lambda old=old: old)

    def remove(self, key: str) -> None:
        with self._lock:
            old = self._chunks.pop(key, None)
            if old is not None:
                self._bytes -= sum(len(data) for data in old.values())

    def stored_keys(self) -> list[str]:
        with self._lock:
            return list(self._chunks)

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._bytes = 0

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._chunks), self._bytes, self.capacity)

    def describe(self) -> str:
        return f"host:{self.capacity}"
