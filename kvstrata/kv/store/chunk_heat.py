"""How often each stored chunk was used and how much of it mattered: what IMPRESS's score-based tier management
ranks chunks by (§3.4, papers/impress.md: score = access frequency x important tokens in the chunk).

A use is one load reading the chunk (whole, or some of its objects). The important share is the fraction of the
chunk's (token, layer) pairs the last importance-based load chose; until one has, a chunk counts as wholly
important (a whole load reads every token). Entries outlive the chunk in any one tier: a chunk dropped from
host memory keeps its history, so when a later load finds it on disk its score says whether to bring it back.
The table is bounded: past `max_entries`, every count is halved and those that reach zero are forgotten (old
popularity fades, and the memory stays bounded).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ChunkHeat:
    def __init__(self, max_entries: int = 1 << 20):
        self.max_entries = max_entries
        self._uses: dict[str, float] = {}
        self._important: dict[str, float] = {}  # chunks a selective load has scored
        self._lock = threading.Lock()
        self.on_aged: list[Callable[[], None]] = []  # told after counts were halved (scores changed everywhere)

    def record(self, key: str, important_share: float | None = None) -> float:
        """One use of chunk `key`; `important_share` in [0, 1]: what share of it the load chose (None: unknown).
        Returns the chunk's important share now in force."""
        if important_share is not None and not 0 <= important_share <= 1:
            raise ValueError(f"important_share {important_share!r} of chunk {key[:16]} must be in [0, 1]")
        with self._lock:
            self._uses[key] = self._uses.get(key, 0.0) + 1
            if important_share is not None:
                self._important[key] = important_share
            share = self._important.get(key, 1.0)
            aged = len(self._uses) > self.max_entries
            if aged:
                self._age()
        if aged:
            for listener in self.on_aged:
                listener()
        return share

    def _age(self) -> None:
        for key, uses in list(self._uses.items()):
            if uses >= 2:
                self._uses[key] = uses / 2
            else:
                del self._uses[key]
                self._important.pop(key, None)

    def uses(self, key: str) -> float:
        with self._lock:
            return self._uses.get(key, 0.0)

    def important_share(self, key: str) -> float:
        with self._lock:
            return self._important.get(key, 1.0)

    def score(self, key: str) -> float:
        """IMPRESS's chunk score: uses x important share."""
        with self._lock:
            return self._uses.get(key, 0.0) * self._important.get(key, 1.0)
