"""The tiers in order, top first, each with the form it writes: fetch a chunk from the highest tier that holds
it (checked, decoded, promoted to the tiers above), write a chunk to every tier (write-through, so other
engines sharing a lower tier see it at once), and cascade a chunk a tier drops to the tier below it. A chunk
moving between tiers of different forms is decoded and encoded again; objects are read in whatever form
their header names.

Synchronous and thread-safe; engine/kv_store_link.py runs it on background threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvstrata.kv.store.errors import CorruptObject, StoreUnavailable
from kvstrata.kv.store.forms import StoredForm, written_form
from kvstrata.kv.store.objects import ObjectHeader, pack_object, unpack_object
from kvstrata.kv.store.tier import Objects, Tier

log = logging.getLogger("kvstrata.kv.store")


@dataclass(frozen=True)
class StoreShape:
    namespace: str  # model fingerprint and the device cache's stored form: objects of another never match
    num_layers: int
    kv_heads: int
    head_dim: int


@dataclass
class StoreStats:
    decode_seconds: float = 0.0
    encode_seconds: float = 0.0
    corrupt_objects: int = 0  # objects that failed their check: dropped, their tokens recomputed

    def to_json(self) -> dict:
        return asdict(self)


class TieredStore:
    def __init__(self, tiers: list[Tier], forms: list[StoredForm], shape: StoreShape,
                 defer: Callable[[Callable[[], None], int], None] | None = None):
        if len(forms) != len(tiers):
            raise ValueError(f"{len(forms)} forms for {len(tiers)} tiers")
        self.tiers = tiers
        self.forms = forms  # what each tier writes
        self.shape = shape
        # Runs work a fetch need not wait for (copying a hit to the tiers above; the bytes it holds); default: now.
        self.defer = defer or (lambda work, size: work())
        self.stats = StoreStats()
        for below, tier in enumerate(tiers[1:], start=1):
            tiers[below - 1].on_evict = lambda key, read, below=below: self._spill(below, key, read)
        self.object_names = [f"{kind}.{layer}" for layer in range(shape.num_layers) for kind in "kv"]

    def locate(self, key: str) -> int | None:
        """The index of the highest tier holding chunk `key`; an unreachable tier counts as not holding it."""
        for index, tier in enumerate(self.tiers):
            try:
                if tier.contains(key):
                    return index
            except StoreUnavailable as exc:
                tier.stats.errors += 1
                log.warning("%s", exc)
        return None

    def fetch(self, key: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V [layers, num_tokens, kv_heads, head_dim] (float32) of chunk `key`; None if no tier holds it.

        An object that fails its check is dropped from its tier (CorruptObject is raised); an unreachable tier
        raises StoreUnavailable. A hit is copied to the tiers above the one it came from.
        """
        index = self.locate(key)
        if index is None:
            for tier in self.tiers:
                tier.stats.miss_tokens += num_tokens
            return None
        tier = self.tiers[index]
        start = time.perf_counter()
        try:
            objects = tier.get(key, self.object_names)
        except StoreUnavailable:
            tier.stats.errors += 1
            raise
        except CorruptObject:
            self._drop(tier, key)
            raise
        fetched = time.perf_counter()
        tier.stats.fetch_seconds += fetched - start
        if objects is None:  # dropped between locate and get
            return None
        tier.stats.bytes_read += sum(len(data) for data in objects.values())
        try:
            k, v, written = self._decode(key, objects, num_tokens)
        except CorruptObject:
            self._drop(tier, key)
            raise
        self.stats.decode_seconds += time.perf_counter() - fetched
        tier.stats.hit_tokens += num_tokens
        for upper in self.tiers[:index]:
            upper.stats.miss_tokens += num_tokens
        if index > 0:
            size = sum(len(data) for data in objects.values()) + 2 * k.numel() * k.element_size()
            self.defer(lambda: self._promote(index, key, objects, written, k, v), size)
        return k, v

    def _promote(self, index: int, key: str, objects: Objects, written: set[str], k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Copy a chunk found in tier `index` to the tiers above that lack it, re-encoded where their form differs."""
        for upper, form in zip(self.tiers[:index], self.forms):
            if not self._holds(upper, key):
                self._put(upper, key, objects if written == {form.name} else self.encode(key, k, v, form))

    def _decode(self, key: str, objects: Objects, num_tokens: int | None):
        """K and V from a chunk's objects, each decoded in the form its header names (`num_tokens`: the length
        the chunk must have; None takes it from the first object), and the set of forms they were in."""
        layers, written = {"k": [], "v": []}, set()
        for layer in range(self.shape.num_layers):
            for kind in "kv":
                name = f"{kind}.{layer}"
                if name not in objects:
                    raise CorruptObject(f"chunk {key[:16]} lacks its object {name}")
                header, payload = unpack_object(objects[name], self.shape.namespace, key, name)
                num_tokens = header.shape[0] if num_tokens is None and header.shape else num_tokens
                want = (num_tokens, self.shape.kv_heads, self.shape.head_dim)
                if header.shape != want:
                    raise CorruptObject(f"object {name} of chunk {key[:16]} has shape {header.shape}, expected {want}")
                written.add(header.form)
                form = written_form(header.form)
                layers[kind].append(form.decode(payload, want, kind, layer, self.shape.num_layers))
        return torch.stack(layers["k"]), torch.stack(layers["v"]), written

    def _drop(self, tier: Tier, key: str) -> None:
        self.stats.corrupt_objects += 1
        tier.stats.errors += 1
        try:
            tier.remove(key)
        except StoreUnavailable as exc:
            log.warning("%s", exc)

    def encode(self, key: str, k: torch.Tensor, v: torch.Tensor, form: StoredForm) -> Objects:
        """The objects of chunk `key` in `form` from K and V [layers, tokens, kv_heads, head_dim]."""
        start = time.perf_counter()
        objects = {}
        for layer in range(self.shape.num_layers):
            for kind, x in (("k", k[layer]), ("v", v[layer])):
                name = f"{kind}.{layer}"
                payload = form.encode(x, kind, layer, self.shape.num_layers)
                header = ObjectHeader(self.shape.namespace, key, name, form.name, tuple(x.shape))
                objects[name] = pack_object(header, payload)
        self.stats.encode_seconds += time.perf_counter() - start
        return objects

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write chunk `key` to every tier that lacks it (encoded once per form); a tier that fails is counted
        and skipped."""
        encoded: dict[str, Objects] = {}
        for tier, form in zip(self.tiers, self.forms):
            if not self._holds(tier, key):
                if form.name not in encoded:
                    encoded[form.name] = self.encode(key, k, v, form)
                self._put(tier, key, encoded[form.name])

    def _holds(self, tier: Tier, key: str) -> bool:
        try:
            return tier.contains(key)
        except StoreUnavailable:
            tier.stats.errors += 1
            return True  # unreachable: nothing to write to

    def _put(self, tier: Tier, key: str, objects: Objects) -> None:
        try:
            tier.put(key, objects)
        except StoreUnavailable as exc:
            tier.stats.errors += 1
            log.warning("%s", exc)
            return
        tier.stats.chunks_written += 1
        tier.stats.bytes_written += sum(len(data) for data in objects.values())

    def _spill(self, below: int, key: str, read) -> None:
        """A chunk tier below - 1 drops goes down to tier `below` unless that one holds it already."""
        tier = self.tiers[below]
        if not self._holds(tier, key):
            try:
                objects = read()
                k, v, written = self._decode(key, objects, None)
                if written != {self.forms[below].name}:
                    objects = self.encode(key, k, v, self.forms[below])
            except Exception:  # an unreadable or corrupt chunk is simply not moved down
                log.exception("chunk %s could not be read to move it down", key[:16])
                return
            self._put(tier, key, objects)

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
