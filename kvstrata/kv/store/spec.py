"""`--kv-store` specifications: tiers in order, comma-separated.

    host:4GiB                       host memory, 4 GiB
    disk:/var/cache/kvstrata:20GiB  one directory, 20 GB budget
    redis://127.0.0.1:6379[/db]     a Redis server
"""

from __future__ import annotations

from kvstrata.config import parse_memory_size
from kvstrata.errors import KvstrataError
from kvstrata.kv.store.disk_tier import DiskTier
from kvstrata.kv.store.errors import StoreUnavailable
from kvstrata.kv.store.eviction import EvictionPolicy
from kvstrata.kv.store.host_tier import HostTier
from kvstrata.kv.store.redis_tier import RedisTier
from kvstrata.kv.store.tier import Tier

EXAMPLE = "host:4GiB,disk:/var/cache/kvstrata:20GiB,redis://127.0.0.1:6379"


def parse_tiers(spec: str, timeout: float = 1.0, host_policy: EvictionPolicy | None = None) -> list[Tier]:
    """The tiers a specification names, top first (a host tier keeping chunks by `host_policy`, by default least
    recently used); a KvstrataError naming the part that is not understood."""
    parts = [part.strip() for part in str(spec).split(",")]
    if not spec or not all(parts):
        raise KvstrataError(f"kv_store {spec!r} is empty or has an empty part; e.g. {EXAMPLE}")
    tiers = [_tier(part, timeout, host_policy) for part in parts]
    kinds = [tier.name for tier in tiers]
    if kinds.count("host") > 1:
        raise KvstrataError(f"kv_store {spec!r} names more than one host tier")
    return tiers


def tier_kinds(spec: str) -> list[str | None]:
    """The kind of tier (host, disk, redis; None where not understood) each part of a specification names, without
    opening any."""
    return [tier_kind(part.strip()) for part in str(spec).split(",")]


def tier_kind(part: str) -> str | None:
    if part.startswith(("redis://", "rediss://", "unix://")):
        return "redis"
    return next((kind for kind in ("host", "disk") if part.startswith(f"{kind}:")), None)


def _tier(part: str, timeout: float, host_policy: EvictionPolicy | None) -> Tier:
    kind = tier_kind(part)
    if kind == "redis":
        return RedisTier(part, timeout=timeout)
    if kind == "host":
        return HostTier(_size(part, part[len("host:"):]), host_policy)
    if kind == "disk":
        directory, size = disk_part(part)
        if not directory:
            raise KvstrataError(f"kv_store part {part!r} needs a directory and a size, e.g. disk:/var/cache/kvstrata:20GiB")
        try:
            return DiskTier(directory, _size(part, size))
        except StoreUnavailable as exc:
            raise KvstrataError(f"kv_store part {part!r}: {exc}") from None
    raise KvstrataError(f"kv_store part {part!r} is not a tier; use host:SIZE, disk:DIR:SIZE or redis://HOST:PORT "
                        f"(e.g. {EXAMPLE})")


def disk_part(part: str) -> tuple[str, str]:
    """(directory, size text) of a `disk:DIR:SIZE` part; the directory may itself hold colons."""
    directory, _, size = part[len("disk:"):].rpartition(":")
    return directory, size


def _size(part: str, text: str) -> int:
    try:
        size = parse_memory_size(text)
    except KvstrataError:
        raise KvstrataError(f"kv_store part {part!r}: {text!r} is not a size; use e.g. 4GiB or 512MiB") from None
    if size <= 0:
        raise KvstrataError(f"kv_store part {part!r}: the size must be positive")
    return size
