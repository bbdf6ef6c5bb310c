"""The tiers in order, top first, each with the form it writes: fetch a chunk from the highest tier that holds
it (checked, decoded, promoted to the tiers above), write a chunk to every tier (write-through, so other
engines sharing a lower tier see it at once), and cascade a chunk a tier drops to the tier below it. A chunk
moving between tiers of different forms is decoded and encoded again; objects are read in whatever form
their header names. A tier in the levels form holds each chunk at several levels (forms.py), and a
reader picks the level of each chunk it reads (engine/kv_store_link.py streams them).

Synchronous and thread-safe; engine/kv_store_link.py runs it on background threads.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from kvstrata.kv.store.chunk_heat import ChunkHeat
from kvstrata.kv.store.errors import CorruptObject, StoreUnavailable
from kvstrata.kv.store.forms import STREAMED_LEVELS, FloatForm, LeveledForm, StoredForm, written_form
from kvstrata.kv.store.objects import ObjectHeader, pack_object, unpack_object
from kvstrata.kv.store.tier import Objects, Tier

if TYPE_CHECKING:  # the profile module calibrates by running the model; the store only reads a profile
    from kvstrata.cachegen.profile import CodecProfile

log = logging.getLogger("kvstrata.kv.store")
MANIFEST = "levels"  # the object of a chunk stored at several levels that gives each level's size in bytes
PROBE_FORM = FloatForm(torch.float16)  # probe keys: only scored, so float16 whatever the chunk's form


def probe_name(layer: int) -> str:
    """The object holding the probe heads' keys of `layer` (TieredStore's `probe_kv_heads`)."""
    return f"p.{layer}"


def level_field(level: str, name: str) -> str:
    """Where a chunk stored at several levels keeps object `name` of `level`."""
    return f"{level}/{name}"


@dataclass(frozen=True)
class StoreShape:
    namespace: str  # model fingerprint and the device cache's stored form: objects of another never match
    num_layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Located:
    key: str
    tier: int  # the index of the highest tier holding the chunk
    level_bytes: dict[str, int] | None = None  # stored at several levels: each one's size, best quality first


@dataclass
class Fetched:
    located: Located
    objects: Objects  # "k.<layer>", "v.<layer>", in one form
    seconds: float  # the read took

    @property
    def num_bytes(self) -> int:
        return sum(len(data) for data in self.objects.values())

    @property
    def bytes_per_second(self) -> float:
        """The throughput the read got."""
        return self.num_bytes / max(self.seconds, 1e-6)

    def joined(self, rest: Fetched) -> Fetched:
        """This read's objects and those of `rest`, a later read of the same chunk's other layers."""
        return Fetched(self.located, {**self.objects, **rest.objects}, self.seconds + rest.seconds)


@dataclass
class StoreStats:
    decode_seconds: float = 0.0  # summed over the threads decoding (may exceed the wall time they took)
    encode_seconds: float = 0.0
    corrupt_objects: int = 0  # objects that failed their check: dropped, their tokens recomputed

    def to_json(self) -> dict:
        return asdict(self)


class TieredStore:
    def __init__(self, tiers: list[Tier], forms: list[StoredForm | LeveledForm], shape: StoreShape,
                 defer: Callable[[Callable[[], None], int], None] | None = None, profile: CodecProfile | None = None,
                 probe_kv_heads: int = 0, heat: ChunkHeat | None = None):
        """`profile`: the model's CacheGen profile, if it has one: CacheGen objects were then written with its steps
        (every engine of one model and kvstrata version agrees; the objects' version says which), and those coded
        over its transforms' components decode with it (the namespace names it: kv_store_link.py). `probe_kv_heads`: also write,
        per layer, the keys of KV heads 0 .. n-1 in float16 ("p.<layer>", outside any level), which IMPRESS reads
        to choose a layer's tokens before reading any K or V (engine/important_prefix_load.py). `heat`: the uses
        and important shares of chunks that the tiers' eviction policies rank by (the one they were built with)."""
        if len(forms) != len(tiers):
            raise ValueError(f"{len(forms)} forms for {len(tiers)} tiers")
        self.tiers = tiers
        self.forms = forms  # what each tier writes
        self.shape = shape
        self.profile = profile
        self._readers: dict[str, StoredForm] = {}  # the forms objects' headers name, as read (written_form)
        # Runs work a fetch need not wait for (copying a hit to the tiers above; the bytes it holds); default: now.
        self.defer = defer or (lambda work, size: work())
        self.stats = StoreStats()
        # The counters that decoding updates (hits, misses, uses, corrupt objects), on several threads at once
        self._counting = threading.Lock()
        self.heat = heat or ChunkHeat()
        self.heat.on_aged.append(lambda: [tier.rescore() for tier in self.tiers])
        for below, tier in enumerate(tiers[1:], start=1):
            tiers[below - 1].on_evict = lambda key, read, below=below: self._spill(below, key, read)
        self.object_names = [f"{kind}.{layer}" for layer in range(shape.num_layers) for kind in "kv"]
        self.probe_kv_heads = probe_kv_heads
        self.probe_names = [probe_name(layer) for layer in range(shape.num_layers)] if probe_kv_heads else []

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

    def find(self, key: str, num_tokens: int) -> Located | None:
        """Where chunk `key` is (and, stored at several levels, each level's size); None, counted as a miss of
        `num_tokens` in every tier, if no tier holds it. A corrupt manifest drops the chunk (CorruptObject)."""
        index = self.locate(key)
        if index is None:
            with self._counting:
                for tier in self.tiers:
                    tier.stats.miss_tokens += num_tokens
            return None
        if not isinstance(self.forms[index], LeveledForm):
            return Located(key, index)
        tier = self.tiers[index]
        manifest = self._get(tier, key, [MANIFEST])
        if manifest is None:  # written by an engine storing one form here: read as such
            return Located(key, index)
        try:
            return Located(key, index, self._level_bytes(key, manifest[MANIFEST]))
        except CorruptObject:
            self._drop(tier, key)
            raise

    def _level_bytes(self, key: str, data: bytes) -> dict[str, int]:
        _, payload = unpack_object(data, self.shape.namespace, key, MANIFEST)
        try:
            sizes = dict(json.loads(payload))
            ordered = {level: int(sizes[level]) for level in STREAMED_LEVELS if level in sizes}
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptObject(f"the manifest of chunk {key[:16]} is unreadable: {exc}") from None
        if not ordered or set(ordered) != set(sizes) or min(ordered.values()) <= 0:
            raise CorruptObject(f"the manifest of chunk {key[:16]} names levels {sorted(sizes)}, expected a subset "
                                f"of {list(STREAMED_LEVELS)} with positive sizes")
        return ordered

    def read(self, where: Located, level: str | None = None, layers: range | None = None,
             names: list[str] | None = None) -> Fetched | None:
        """The objects of a located chunk (stored at several levels: at `level`, by default the best; only those
        of `layers`, by default all; or exactly `names`, of a chunk stored in one form), timed; None if it went
        away meanwhile. StoreUnavailable if its tier is unreachable; a corrupt chunk is dropped (CorruptObject)."""
        tier = self.tiers[where.tier]
        if names is None:
            names = self.object_names if layers is None else [f"{kind}.{layer}" for layer in layers for kind in "kv"]
        elif where.level_bytes is not None:
            raise ValueError(f"chunk {where.key[:16]} is stored at several levels: read it by level and layers")
        fields = names
        if where.level_bytes is not None:
            level = level or next(iter(where.level_bytes))
            if level not in where.level_bytes:
                raise ValueError(f"chunk {where.key[:16]} is not stored at level {level!r}")
            fields = [level_field(level, name) for name in names]
        start = time.perf_counter()
        found = self._get(tier, where.key, fields)
        seconds = time.perf_counter() - start
        if found is None:
            return None
        tier.stats.fetch_seconds += seconds
        objects = {name: found[field] for name, field in zip(names, fields)}
        fetched = Fetched(where, objects, seconds)
        tier.stats.bytes_read += fetched.num_bytes
        return fetched

    def _get(self, tier: Tier, key: str, names: list[str]) -> Objects | None:
        try:
            return tier.get(key, names)
        except StoreUnavailable:
            tier.stats.errors += 1
            raise
        except CorruptObject:
            self._drop(tier, key)
            raise

    def decode(self, fetched: Fetched, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, num_tokens, kv_heads, head_dim] (float32) of a read chunk, counted as a hit and copied
        to the tiers above the one it came from; a corrupt chunk is dropped (CorruptObject)."""
        index, key = fetched.located.tier, fetched.located.key
        tier = self.tiers[index]
        start = time.perf_counter()
        try:
            k, v, written, position = self._decode(key, fetched.objects, num_tokens)
        except CorruptObject:
            self._drop(tier, key)
            raise
        with self._counting:
            self.stats.decode_seconds += time.perf_counter() - start
        self.count_hit(fetched.located, num_tokens)
        self._count_use(fetched.located, None)
        if index > 0:
            size = fetched.num_bytes + 2 * k.numel() * k.element_size()
            self.defer(lambda: self._promote(index, key, fetched.objects, written, k, v, position), size)
        return k, v

    def fetch(self, key: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of chunk `key` from the highest tier holding it (at its best level); None if no tier holds it.
        Raises as find, read and decode do."""
        where = self.find(key, num_tokens)
        fetched = where and self.read(where)
        return None if fetched is None else self.decode(fetched, num_tokens)

    def _promote(self, index: int, key: str, objects: Objects, written: set[str], k: torch.Tensor,
                 v: torch.Tensor, position: int | None) -> None:
        """Copy a chunk found in tier `index` to the tiers above that lack it, re-encoded where their form differs."""
        for upper, form in zip(self.tiers[:index], self.forms):
            if not self._holds(upper, key):
                self._put(upper, key, self._objects_in(form, key, objects, written, k, v, position))

    def _objects_in(self, form: StoredForm | LeveledForm, key: str, objects: Objects, written: set[str],
                    k: torch.Tensor, v: torch.Tensor, position: int | None) -> Objects:
        """A chunk's objects for a tier writing `form`: those read, where they are in that form and hold the probe
        keys (a read of K and V leaves them out), else K and V encoded again."""
        if all(name in objects for name in self.probe_names) and written == {form.at(position).name}:
            return objects
        return self.encode(key, k, v, form, position=position)

    def _decode(self, key: str, objects: Objects, num_tokens: int | None):
        """K and V from a chunk's objects, decoded in the form their headers name (`num_tokens`: the length the
        chunk must have; None takes it from the first object), the set of forms they were in, and the position
        of the chunk's first token (None: not in order). Consecutive layers in one form are decoded in one call
        (StoredForm.decode_layers); a streamed chunk's first layers may come at another level (its probe)."""
        runs: dict[str, list[tuple[str, dict[int, bytes]]]] = {"k": [], "v": []}  # (form, layer -> payload)
        positions = set()
        for kind in "kv":
            for layer in range(self.shape.num_layers):
                name = f"{kind}.{layer}"
                if name not in objects:
                    raise CorruptObject(f"chunk {key[:16]} lacks its object {name}")
                header, payload, want = self._unpack(key, name, objects[name], num_tokens)
                num_tokens = want[0]
                positions.add(header.position)
                if not runs[kind] or runs[kind][-1][0] != header.form:
                    runs[kind].append((header.form, {}))
                runs[kind][-1][1][layer] = payload
        if len(positions) != 1:
            raise CorruptObject(f"the objects of chunk {key[:16]} name different positions: {sorted(map(str, positions))}")
        position = positions.pop()
        k, v = (_joined([self._reader(form).decode_layers(payloads, want, kind, self.shape.num_layers, position)
                         for form, payloads in runs[kind]]) for kind in "kv")
        return k, v, {form for kind in "kv" for form, _ in runs[kind]}, position

    def read_objects(self, where: Located, names: list[str], num_tokens: int
                     ) -> tuple[dict[str, torch.Tensor], int] | None:
        """Some objects of a chunk stored in one form ("k.<layer>", "v.<layer>" or a probe's "p.<layer>"), read in
        one call, checked and decoded to float32 [num_tokens, heads, head_dim] each, with the bytes read; None if
        the tier no longer holds them. Raises as `read` does; a corrupt object drops its chunk (CorruptObject)."""
        fetched = self.read(where, names=names)
        if fetched is None:
            return None
        return {name: self.decode_read(where, name, fetched.objects[name], num_tokens)
                for name in names}, fetched.num_bytes

    def decode_read(self, where: Located, name: str, data: bytes, num_tokens: int | None) -> torch.Tensor:
        """`decode_object` of an object read from `where`; a corrupt one drops its chunk (CorruptObject)."""
        try:
            return self.decode_object(where.key, name, data, num_tokens)
        except CorruptObject:
            self._drop(self.tiers[where.tier], where.key)
            raise

    def decode_object(self, key: str, name: str, data: bytes, num_tokens: int | None) -> torch.Tensor:
        """One object of chunk `key` ("k.<layer>", "v.<layer>" or a probe's "p.<layer>"), checked and decoded, in
        the form and at the position its header names, to float32 [num_tokens (None: as its header says), heads,
        head_dim]; CorruptObject if it is not whole or not that object (the caller drops the chunk)."""
        header, payload, want = self._unpack(key, name, data, num_tokens)
        kind, layer = name.split(".")[0], int(name.split(".")[1])
        kind = "k" if kind == "p" else kind
        return self._reader(header.form).decode(payload, want, kind, layer, self.shape.num_layers, header.position)

    def _unpack(self, key: str, name: str, data: bytes, num_tokens: int | None
                ) -> tuple[ObjectHeader, bytes, tuple[int, int, int]]:
        """An object's header and payload, checked (objects.py), and the shape it decodes to."""
        header, payload = unpack_object(data, self.shape.namespace, key, name)
        num_tokens = header.shape[0] if num_tokens is None and header.shape else num_tokens
        heads = self.probe_kv_heads if name.startswith("p.") else self.shape.kv_heads
        want = (num_tokens, heads, self.shape.head_dim)
        if header.shape != want:
            raise CorruptObject(f"object {name} of chunk {key[:16]} has shape {header.shape}, expected {want}")
        return header, payload, want

    def _reader(self, form_name: str) -> StoredForm:
        """The form an object's header names, as read (CorruptObject for one this version or profile cannot read)."""
        form = self._readers.get(form_name)
        if form is None:
            form = self._readers.setdefault(form_name, written_form(form_name, self.profile))
        return form

    def count_hit(self, where: Located, num_tokens: int) -> None:
        """The `num_tokens` tokens of a located chunk served a load: a hit of its tier, a miss of those above."""
        with self._counting:
            self.tiers[where.tier].stats.hit_tokens += num_tokens
            for upper in self.tiers[: where.tier]:
                upper.stats.miss_tokens += num_tokens

    def note_use(self, where: Located, num_tokens: int, important_share: float | None) -> None:
        """A load used some objects of a located object set (a chunk, a reordered node's physical chunk or
        sidecar) of `num_tokens` tokens, of which it chose `important_share` (None: unknown): its use is counted
        for the eviction policies, and it is copied whole, as stored, to each tier above that lacks it and would
        keep it (read again on the write thread: the load read only part of it)."""
        self._count_use(where, important_share)
        uppers = [upper for upper in self.tiers[: where.tier] if upper.would_keep(where.key)]  # none held it
        if uppers:
            shape = self.shape
            size = 2 * shape.num_layers * num_tokens * shape.kv_heads * shape.head_dim * 4  # at most float32 K, V
            self.defer(lambda: self._copy_up(where, uppers), size)

    def _count_use(self, where: Located, important_share: float | None) -> None:
        weight = self.heat.record(where.key, important_share)
        tier = self.tiers[where.tier]
        with self._counting:
            tier.stats.chunk_hits += 1
            tier.stats.important_hits += weight
            for upper in self.tiers[: where.tier]:
                upper.stats.chunk_misses += 1
                upper.stats.important_misses += weight
        tier.used(where.key)

    def _copy_up(self, where: Located, uppers: list[Tier]) -> None:
        """Copy every object of `where`, in the form it is stored in (its headers name it), to `uppers`."""
        found = self._get(self.tiers[where.tier], where.key, None)
        if found is None:
            return
        self.tiers[where.tier].stats.bytes_promoted += sum(len(data) for data in found.values())
        for upper in uppers:
            if not self._holds(upper, where.key) and self._put(upper, where.key, found):
                upper.stats.chunks_promoted += 1

    def _drop(self, tier: Tier, key: str) -> None:
        with self._counting:
            self.stats.corrupt_objects += 1
            tier.stats.errors += 1
        try:
            tier.remove(key)
        except StoreUnavailable as exc:
            log.warning("%s", exc)

    def encode(self, key: str, k: torch.Tensor, v: torch.Tensor, form: StoredForm | LeveledForm,
               probes: bool = True, position: int | None = None) -> Objects:
        """The objects of chunk `key` in `form` from K and V [layers, tokens, kv_heads, head_dim] whose first token
        sits at `position` in its context (None: the tokens are not in order); in the levels form, each level's
        objects under "<level>/<name>" and a manifest of their sizes; the probe keys, if the store writes them and
        `probes`, in float16 under their own names."""
        objects = self.probe_objects(key, k) if probes else {}
        if not isinstance(form, LeveledForm):
            return {**self._encode_form(key, k, v, form, position), **objects}
        sizes = {}
        for level in form.levels:
            encoded = self._encode_form(key, k, v, level, position)
            sizes[level.name] = sum(len(data) for data in encoded.values())
            objects.update({level_field(level.name, name): data for name, data in encoded.items()})
        header = ObjectHeader(self.shape.namespace, key, MANIFEST, form.name, ())
        objects[MANIFEST] = pack_object(header, json.dumps(sizes).encode())
        return objects

    def probe_objects(self, key: str, k: torch.Tensor) -> Objects:
        """The probe keys of K [layers, tokens, kv_heads, head_dim], per layer, for an object set named `key`."""
        objects = {}
        for layer, name in enumerate(self.probe_names):
            x = k[layer, :, : self.probe_kv_heads]
            header = ObjectHeader(self.shape.namespace, key, name, PROBE_FORM.name, tuple(x.shape))
            objects[name] = pack_object(header, PROBE_FORM.encode(x, "k", layer, self.shape.num_layers))
        return objects

    def _encode_form(self, key: str, k: torch.Tensor, v: torch.Tensor, form: StoredForm, position: int | None
                     ) -> Objects:
        start = time.perf_counter()
        objects = {}
        form = form.at(position)
        for layer in range(self.shape.num_layers):
            for kind, x in (("k", k[layer]), ("v", v[layer])):
                name = f"{kind}.{layer}"
                payload = form.encode(x, kind, layer, self.shape.num_layers, position)
                header = ObjectHeader(self.shape.namespace, key, name, form.name, tuple(x.shape), position)
                objects[name] = pack_object(header, payload)
        self.stats.encode_seconds += time.perf_counter() - start
        return objects

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor, probes: bool = True, position: int | None = None
            ) -> None:
        """Write chunk `key`, whose first token sits at `position` in its context (None: its tokens are not in
        order), to every tier that lacks it (encoded once per form; `probes`: with the probe keys, if the store
        writes them); a tier that fails is counted and skipped."""
        encoded: dict[str, Objects] = {}
        for tier, form in zip(self.tiers, self.forms):
            if not self._holds(tier, key):
                if form.name not in encoded:
                    encoded[form.name] = self.encode(key, k, v, form, probes, position)
                self._put(tier, key, encoded[form.name])

    # --- records: small objects kept beside the chunks under keys of their own (kv/impress/node_reordering.py) ---

    def put_record(self, key: str, objects: Objects) -> None:
        """Write (or replace) the objects of `key` in every tier; a tier that fails is counted and skipped."""
        self.remove(key)
        for tier in self.tiers:
            self._put(tier, key, objects)

    def read_record(self, key: str, names: list[str]) -> Objects | None:
        """The objects `names` of `key` from the highest tier holding it, counted as read there; None if none does
        (or one is unreachable). The caller checks them (a corrupt one: `remove`)."""
        index = self.locate(key)
        try:
            fetched = None if index is None else self.read(Located(key, index), names=names)
        except StoreUnavailable as exc:
            log.warning("%s", exc)
            return None
        return fetched and fetched.objects

    def remove(self, key: str) -> None:
        """Drop `key` from every tier (an unreachable one is skipped)."""
        for tier in self.tiers:
            try:
                tier.remove(key)
            except StoreUnavailable as exc:
                tier.stats.errors += 1
                log.warning("%s", exc)

    def stored_keys(self, prefix: str) -> set[str]:
        """The keys beginning with `prefix` that some reachable tier holds."""
        found = set()
        for tier in self.tiers:
            try:
                found.update(key for key in tier.stored_keys() if key.startswith(prefix))
            except StoreUnavailable as exc:
                tier.stats.errors += 1
                log.warning("%s", exc)
        return found

    def _holds(self, tier: Tier, key: str) -> bool:
        try:
            return tier.contains(key)
        except StoreUnavailable:
            tier.stats.errors += 1
            return True  # unreachable: nothing to write to

    def _put(self, tier: Tier, key: str, objects: Objects) -> bool:
        """Whether `tier` stored the objects (an unreachable tier is counted and skipped)."""
        try:
            stored = tier.put(key, objects)
        except StoreUnavailable as exc:
            tier.stats.errors += 1
            log.warning("%s", exc)
            return False
        if stored:
            tier.stats.chunks_written += 1
            tier.stats.bytes_written += sum(len(data) for data in objects.values())
        return stored

    def _spill(self, below: int, key: str, read) -> None:
        """A chunk tier below - 1 drops goes down to tier `below` unless that one holds it already."""
        tier = self.tiers[below]
        if not self._holds(tier, key):
            try:
                objects = _best_level(read())
                k, v, written, position = self._decode(key, objects, None)
                objects = self._objects_in(self.forms[below], key, objects, written, k, v, position)
            except Exception:  # an unreadable or corrupt chunk is simply not moved down
                log.exception("chunk %s could not be read to move it down", key[:16])
                return
            self._put(tier, key, objects)

    def begin_load(self) -> None:
        """A load starts (tiers behind an emulated link restart its trace)."""
        for tier in self.tiers:
            tier.begin_load()

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _best_level(objects: Objects) -> Objects:
    """A chunk's objects under their plain names: those of its best level if it is stored at several."""
    if MANIFEST not in objects:
        return objects
    level = next(level for level in STREAMED_LEVELS if level_field(level, "k.0") in objects)
    prefix = level_field(level, "")
    return {name.removeprefix(prefix): data for name, data in objects.items() if name.startswith(prefix)}
