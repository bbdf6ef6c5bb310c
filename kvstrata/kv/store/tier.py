"""What every tier of the store offers: whole chunks in, any subset of a chunk's objects out.

A chunk is stored whole (all of its objects in one write), so a tier that holds a chunk holds all
of its objects. Tiers keep bytes only; encoding, checking and decoding happen in the store above.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass

Objects = dict[str, bytes]  # object name ("k.3", "v.3", ...) -> stored bytes
# Told (chunk key, a reader of its objects) just before a tier drops a chunk to make room.
EvictionHandler = Callable[[str, Callable[[], Objects]], None]


@dataclass
class TierStats:
    hit_tokens: int = 0
    miss_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    chunks_written: int = 0
    chunks_evicted: int = 0
    chunks_refused: int = 0  # not stored: worth less than every chunk they would have displaced (eviction.py)
    chunks_promoted: int = 0  # copied here from a tier below after a load used part of them
    bytes_promoted: int = 0  # read from this tier (off the load's path) to copy chunks to a tier above
    chunk_hits: int = 0  # chunks (or object sets) a load used, read from this tier
    chunk_misses: int = 0  # ... read from a tier below this one
    important_hits: float = 0.0  # chunk_hits weighted by each chunk's important share (chunk_heat.py)
    important_misses: float = 0.0
    fetch_seconds: float = 0.0
    errors: int = 0  # unreachable, timed out, full, or an object that failed its check

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class TierUsage:
    chunks: int
    bytes: int
    capacity: int | None  # None: the tier has no budget of its own (Redis)


class Tier(ABC):
    name: str  # "host", "disk", "redis"

    def __init__(self) -> None:
        self.stats = TierStats()
        self.on_evict: EvictionHandler | None = None

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def get(self, key: str, names: list[str] | None) -> Objects | None:
        """The named objects of a chunk (None: all of them); None if the tier does not hold it (or lacks one)."""

    @abstractmethod
    def put(self, key: str, objects: Objects) -> bool:
        """Store a whole chunk, making room by dropping the chunks the tier values least (told to `on_evict`);
        False if it was left out (larger than the tier, or refused by its eviction policy)."""

    @abstractmethod
    def remove(self, key: str) -> None: ...

    @abstractmethod
    def stored_keys(self) -> list[str]:
        """The keys of every chunk the tier holds."""

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def describe(self) -> str:
        return self.name

    def used(self, key: str) -> None:
        """A load used chunk `key` from this tier (its value to the eviction policy may have changed)."""

    def would_keep(self, key: str) -> bool:
        """Whether storing chunk `key` now would keep it (a tier whose policy refuses low-valued chunks says no
        before the chunk is read from below to be copied here)."""
        return True

    def rescore(self) -> None:
        """Every chunk's value to the eviction policy changed."""

    def begin_load(self) -> None:
        """A load of consecutive chunks starts; nothing to do for most tiers."""

    def close(self) -> None:
        """Release connections and files."""
