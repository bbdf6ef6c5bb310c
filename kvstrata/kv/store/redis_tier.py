"""Chunks in a Redis server: one hash per chunk (its objects as fields), so a chunk is written in one
command and any subset of its objects is read in one.

Redis keeps everything it is given (its own maxmemory policy, if set, decides what goes). Several
engines may share one server: a chunk one of them wrote is a hit for the others. Every command has
a timeout; after a failure the tier is skipped for `retry_seconds`, so a dead server costs a request
one timeout at most, not one per chunk. An emulated link (`link`, emulated_link.py) may slow its reads
to a bandwidth trace.
"""

from __future__ import annotations

import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstrata.kv.store.emulated_link import EmulatedLink
from kvstrata.kv.store.errors import StoreUnavailable
from kvstrata.kv.store.tier import Objects, Tier, TierUsage

KEY_PREFIX = "kvstrata:chunk:"


class RedisTier(Tier):
    name = "redis"

    def __init__(self, url: str, timeout: float = 1.0, retry_seconds: float = 2.0):
        super().__init__()
        self.url = url
        self.retry_seconds = retry_seconds
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                            retry=Retry(NoBackoff(), 0))
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.link: EmulatedLink | None = None

    def _call(self, what: str, command):
        if time.monotonic() < self._down_until:
            raise StoreUnavailable(f"redis tier {self.url}: skipped after a recent failure")
        try:
            return command(self._client)
        except redis.RedisError as exc:
            with self._lock:
                self._down_until = time.monotonic() + self.retry_seconds
            raise StoreUnavailable(f"redis tier {self.url}: {what} failed: {type(exc).__name__}: {exc}") from None

    def ping(self) -> None:
        """Raises StoreUnavailable where the server does not answer."""
        self._call("PING", lambda r: r.ping())

    def begin_load(self) -> None:
        if self.link is not None:
            self.link.restart()

    def contains(self, key: str) -> bool:
        return bool(self._call("EXISTS", lambda r: r.exists(KEY_PREFIX + key)))

    def get(self, key: str, names: list[str] | None) -> Objects | None:
        began = self.link.now() if self.link is not None else 0.0
        if names is None:
            found = self._call("HGETALL", lambda r: r.hgetall(KEY_PREFIX + key))
            names, values = [name.decode() for name in found], list(found.values())
        else:
            values = self._call("HMGET", lambda r: r.hmget(KEY_PREFIX + key, names))
        if self.link is not None:
            self.link.transfer(sum(len(value) for value in values if value is not None), began)
        if not values or any(value is None for value in values):
            return None
        return dict(zip(names, values))

    def put(self, key: str, objects: Objects) -> bool:
        self._call("HSET", lambda r: r.hset(KEY_PREFIX + key, mapping=objects))
        return True

    def remove(self, key: str) -> None:
        self._call("DEL", lambda r: r.delete(KEY_PREFIX + key))

    def _redis_keys(self) -> list[bytes]:
        return self._call("SCAN", lambda r: list(r.scan_iter(match=KEY_PREFIX + "*", count=1000)))

    def stored_keys(self) -> list[str]:
        return [key.decode()[len(KEY_PREFIX) :] for key in self._redis_keys()]

    def clear(self) -> None:
        keys = self._redis_keys()
        if keys:
            self._call("DEL", lambda r: r.delete(*keys))

    def usage(self) -> TierUsage:
        keys = self._redis_keys()
        sizes = self._call("MEMORY USAGE", lambda r: [r.memory_usage(k) or 0 for k in keys])
        return TierUsage(len(keys), sum(sizes), None)

    def describe(self) -> str:
        return self.url

    def close(self) -> None:
        self._client.close()
