"""Chunks as files in one directory, within a byte budget, least recently used dropped first.

A chunk file is written under a temporary name and renamed into place, so a reader (or a restart)
never sees half a chunk; the index is rebuilt from the directory on start, oldest file first, so a
restarted engine finds what was stored. A write that fails (a full disk, a read-only directory) is
skipped: the tier raises StoreUnavailable and serving goes on without it.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path

from kvstrata.kv.store.errors import CorruptObject, StoreUnavailable
from kvstrata.kv.store.tier import Objects, Tier, TierUsage

MAGIC = b"KVSC\x01"
_COUNT = struct.Struct("<H")
_ENTRY = struct.Struct("<HQ")  # name length, data length
SUFFIX = ".kvc"


class DiskTier(Tier):
    name = "disk"

    def __init__(self, directory: str | Path, capacity: int):
        super().__init__()
        self.directory = Path(directory)
        self.capacity = capacity
        self._lock = threading.Lock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"the disk tier's directory {self.directory} cannot be created: {exc}") from None
        self._sizes: OrderedDict[str, int] = self._scan()
        self._used = sum(self._sizes.values())  # kept with _sizes, so a write need not add up the index

    def _scan(self) -> OrderedDict[str, int]:
        """The chunks already in the directory, least recently used first; leftovers of interrupted writes go."""
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                stat = path.stat()
                found.append((stat.st_mtime, path.name[: -len(SUFFIX)], stat.st_size))
        return OrderedDict((key, size) for _, key, size in sorted(found))

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes

    def get(self, key: str, names: list[str] | None) -> Objects | None:
        with self._lock:
            if key not in self._sizes:
                return None
            self._sizes.move_to_end(key)
        try:
            objects = read_chunk_file(self._path(key), names)
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            raise StoreUnavailable(f"disk tier: reading {self._path(key)} failed: {exc}") from None
        try:
            os.utime(self._path(key))  # recency survives a restart
        except OSError:
            pass  # a read-only directory still serves its chunks
        return objects

    def put(self, key: str, objects: Objects) -> bool:
        data = chunk_file_bytes(objects)
        if len(data) > self.capacity:
            return False
        with self._lock:
            if key in self._sizes:
                return True
            victims = []
            while self._used + len(data) > self.capacity and self._sizes:
                old_key, old_size = self._sizes.popitem(last=False)
                self._used -= old_size
                victims.append(old_key)
        for old_key in victims:
            path = self._path(old_key)
            try:
                if self.on_evict is not None:
                    self.on_evict(old_key, lambda path=path: read_chunk_file(path, None))
            finally:
                path.unlink(missing_ok=True)
        self.stats.chunks_evicted += len(victims)
        temporary = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(temporary, "wb") as out:
                out.write(data)
            os.replace(temporary, self._path(key))
        except OSError as exc:  # a full disk, a vanished directory: skip this write
            temporary.unlink(missing_ok=True)
            raise StoreUnavailable(f"disk tier: writing {self._path(key)} failed: {exc}") from None
        with self._lock:
            if key not in self._sizes:
                self._sizes[key] = len(data)
                self._used += len(data)
        return True

    def _forget(self, key: str) -> None:
        with self._lock:
            self._used -= self._sizes.pop(key, 0)

    def remove(self, key: str) -> None:
        self._forget(key)
        self._path(key).unlink(missing_ok=True)

    def stored_keys(self) -> list[str]:
        with self._lock:
            return list(self._sizes)

    def clear(self) -> None:
        with self._lock:
            keys = list(self._sizes)
            self._sizes.clear()
            self._used = 0
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._sizes), self._used, self.capacity)

    def describe(self) -> str:
        return f"disk:{self.directory}:{self.capacity}"


def chunk_file_bytes(objects: Objects) -> bytes:
    parts = [MAGIC, _COUNT.pack(len(objects))]
    parts += [_ENTRY.pack(len(name.encode()), len(data)) + name.encode() for name, data in objects.items()]
    return b"".join(parts + list(objects.values()))


def read_chunk_file(path: Path, names: list[str] | None) -> Objects:
    """The named objects of a chunk file (every object with None), reading only their bytes."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        if f.read(len(MAGIC)) != MAGIC:
            raise CorruptObject(f"{path} is not a kvstrata chunk file")
        (count,) = _COUNT.unpack(_read(f, _COUNT.size, path))
        index, offset = [], 0
        for _ in range(count):
            name_len, length = _ENTRY.unpack(_read(f, _ENTRY.size, path))
            if offset + length > file_size:
                raise CorruptObject(f"{path} names an object longer than the file")
            index.append((_read(f, name_len, path).decode("ascii", "replace"), offset, length))
            offset += length
        data_start = f.tell()
        wanted = {index_name for index_name, _, _ in index} if names is None else set(names)
        objects = {}
        for name, start, length in index:
            if name in wanted:
                f.seek(data_start + start)
                objects[name] = _read(f, length, path)
    missing = wanted - set(objects)
    if missing:
        raise CorruptObject(f"{path} lacks the objects {sorted(missing)[:4]}")
    return objects


def _read(f, size: int, path: Path) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise CorruptObject(f"{path} is truncated")
    return data
