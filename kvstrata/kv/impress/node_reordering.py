"""IMPRESS's reordering (§3.3, papers/impress.md): a stored prefix's tokens sorted per layer by how important the
loads of that prefix found them, so that the tokens a layer chooses share few chunks and a selective load reads
fewer of them.

A node is a run of `NODE_CHUNKS` consecutive chunks of a stored prefix, from its first chunk on (chunks 0-15,
16-31, ...), named by the key of its last chunk: the chained hash of every token up to the node's end, so two
prefixes that part inside a node have two nodes, and reordering never crosses nodes. Three kinds of record live
in the store beside the chunks, under keys of their own (TieredStore's records):
- `s.<node>` (`importance`): per (layer, token) the running average over the node's loads of the share of the
  layer's probe-head attention the token drew, the number of loads, and the node's chunk keys;
- `r<version>.<node>.<j>`: physical chunk j of a reordered node: per layer, K and V of the tokens at positions
  j*C .. (j+1)*C of that layer's order (the most important first);
- `r<version>.<node>.p`: the node's probe keys per layer (`p.<layer>`), in logical order, so a load scores a
  layer's node tokens from one read instead of one per chunk (the paper's probe sidecar per node and layer);
- `m.<node>` (`map`): the version and each layer's order (physical position -> logical token).
A pass writes the physical chunks of a new version first and the map last, then removes the old version's
chunks: a reader that took a map reads chunks of that version, or finds one gone and reads the logical chunks
instead (engine/important_prefix_load.py); no reader ever sees half of a node.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.kv.store.errors import CorruptObject, StoreUnavailable
from kvstrata.kv.store.objects import ObjectHeader, pack_object, unpack_object
from kvstrata.kv.store.tiered_store import TieredStore

log = logging.getLogger("kvstrata.kv.impress")

NODE_CHUNKS = 16  # chunks per node: 1,024 tokens at the paper's 64-token chunks
IMPORTANCE, MAP = "importance", "map"
_META_LENGTH = struct.Struct("<I")
RECORD_DTYPES = ("float16", "int16", "int32")  # importance; a map (int32 beyond int16's 32,767 tokens)


def importance_key(node: str) -> str:
    return f"s.{node}"


def map_key(node: str) -> str:
    return f"m.{node}"


def physical_key(node: str, version: int, chunk: int) -> str:
    return f"r{version}.{node}.{chunk}"


def probes_key(node: str, version: int) -> str:
    return f"r{version}.{node}.p"


def node_spans(num_chunks: int) -> list[range]:
    """The whole nodes among a prefix's first `num_chunks` chunks, as ranges of chunk indices (a tail shorter than
    a node is no node: it is read as it was stored)."""
    return [range(start, start + NODE_CHUNKS) for start in range(0, num_chunks - NODE_CHUNKS + 1, NODE_CHUNKS)]


def _pack(store: TieredStore, key: str, name: str, meta: dict, values: torch.Tensor) -> bytes:
    head = json.dumps(meta).encode()
    array = values.contiguous().numpy()
    header = ObjectHeader(store.shape.namespace, key, name, str(array.dtype), tuple(array.shape))
    return pack_object(header, _META_LENGTH.pack(len(head)) + head + array.tobytes())


def _unpack(store: TieredStore, key: str, name: str, data: bytes) -> tuple[dict, torch.Tensor]:
    """A record's meta and values, checked (CorruptObject if it is not whole, not this record, or unreadable)."""
    header, payload = unpack_object(data, store.shape.namespace, key, name)
    if header.form not in RECORD_DTYPES:
        raise CorruptObject(f"record {name} of {key[:20]} holds {header.form!r}, not one of {RECORD_DTYPES}")
    try:
        (length,) = _META_LENGTH.unpack_from(payload)
        meta = json.loads(payload[_META_LENGTH.size : _META_LENGTH.size + length])
        values = np.frombuffer(payload[_META_LENGTH.size + length :], dtype=header.form).reshape(header.shape)
    except (struct.error, ValueError, TypeError) as exc:
        raise CorruptObject(f"record {name} of {key[:20]} is unreadable: {exc}") from None
    return meta, torch.from_numpy(values.copy())


def _read(store: TieredStore, key: str, name: str, drop_corrupt: bool = True
          ) -> tuple[dict, torch.Tensor, int] | None:
    """A record (its meta, its values, the bytes read), None if no tier holds it; one that fails its check counts
    as absent and, with `drop_corrupt`, is removed (not when it may be another model's: see reorder_all)."""
    found = store.read_record(key, [name])
    if found is None:
        return None
    try:
        return *_unpack(store, key, name, found[name]), len(found[name])
    except CorruptObject as exc:
        log.warning("%s%s", exc, ": removed" if drop_corrupt else "")
        if drop_corrupt:
            store.stats.corrupt_objects += 1
            store.remove(key)
        return None


@dataclass
class NodeMap:
    """A reordered node: physical chunk j of `version` holds, in layer l, logical tokens order[l, j*C:(j+1)*C]."""

    version: int
    order: torch.Tensor  # [layers, node tokens], int64
    loads: int  # the importance record's loads when the node was sorted
    bytes_read: int  # what reading the map cost

    def __post_init__(self) -> None:
        self.physical = self.order.argsort(dim=1)  # logical token -> its physical position, per layer


def read_map(store: TieredStore, node: str, num_tokens: int) -> NodeMap | None:
    """The map of `node` ([layers, num_tokens]), None if it was never reordered (an unreadable map is removed)."""
    record = _read(store, map_key(node), MAP)
    if record is None:
        return None
    meta, order, size = record
    want = (store.shape.num_layers, num_tokens)
    valid = tuple(order.shape) == want and bool((order.long().sort(dim=1).values == torch.arange(num_tokens)).all())
    if not valid or not isinstance(meta.get("version"), int):
        log.warning("the map of node %s is not a permutation of %s tokens per layer: removed", node[:16], num_tokens)
        store.stats.corrupt_objects += 1
        store.remove(map_key(node))
        return None
    return NodeMap(meta["version"], order.long(), int(meta.get("loads", 0)), size)


def record_importance(store: TieredStore, node: str, chunk_keys: list[str], scores: torch.Tensor) -> None:
    """Fold one load's per-layer token scores [layers, node tokens] into the node's running average."""
    share = scores.float() / scores.float().sum(1, keepdim=True).clamp_min(1e-30)
    record = _read(store, importance_key(node), IMPORTANCE)
    loads, average = 0, torch.zeros_like(share)
    if record is not None and record[1].shape == share.shape and record[0].get("chunks") == chunk_keys:
        loads, average = int(record[0]["loads"]), record[1].float()
    average = (average * loads + share) / (loads + 1)
    meta = {"loads": loads + 1, "chunks": chunk_keys}
    packed = _pack(store, importance_key(node), IMPORTANCE, meta, average.half())  # ranks need no more digits
    store.put_record(importance_key(node), {IMPORTANCE: packed})


def reorder_node(store: TieredStore, node: str, chunk_tokens: int) -> bool:
    """Sort `node`'s tokens per layer by their running-average importance and write it as a new version (the
    chunks, then the map; then the old version's chunks go); False if there is nothing new to sort by or a
    logical chunk is missing. Raises StoreUnavailable where a tier fails mid-way (the old map stays in force)."""
    # A pass lists every importance record of a shared store; one of another model's namespace fails the check
    # and is left alone (as is everything of its node).
    record = _read(store, importance_key(node), IMPORTANCE, drop_corrupt=False)
    if record is None:
        return False
    importance, average, _ = record
    num_tokens = NODE_CHUNKS * chunk_tokens
    if tuple(average.shape) != (store.shape.num_layers, num_tokens):
        return False
    old = read_map(store, node, num_tokens)
    if old is not None and old.loads == importance["loads"]:
        return False
    k, v = _node_kv(store, importance["chunks"], chunk_tokens)
    if k is None:
        return False
    order = average.argsort(dim=1, descending=True, stable=True)
    version = 1 if old is None else old.version + 1
    store.put_record(probes_key(node, version), store.probe_objects(probes_key(node, version), k))
    layers = torch.arange(store.shape.num_layers)[:, None]
    k, v = k[layers, order], v[layers, order]
    for j in range(NODE_CHUNKS):
        span = slice(j * chunk_tokens, (j + 1) * chunk_tokens)
        store.put(physical_key(node, version, j), k[:, span], v[:, span], probes=False)
    meta = {"version": version, "loads": importance["loads"]}
    order = order.to(torch.int16 if num_tokens <= torch.iinfo(torch.int16).max else torch.int32)
    store.put_record(map_key(node), {MAP: _pack(store, map_key(node), MAP, meta, order)})
    if old is not None:
        for key in [probes_key(node, old.version)] + [physical_key(node, old.version, j) for j in range(NODE_CHUNKS)]:
            store.remove(key)
    return True


def _node_kv(store: TieredStore, chunk_keys: list[str], chunk_tokens: int):
    """K and V [layers, node tokens, kv_heads, head_dim] of a node's logical chunks; (None, None) if one is gone."""
    names = store.object_names
    parts = []
    for key in chunk_keys:
        where = store.find(key, chunk_tokens)
        got = where and store.read_objects(where, names, chunk_tokens)
        if not got:
            return None, None
        parts.append(got[0])
    layers = range(store.shape.num_layers)
    k = torch.stack([torch.cat([part[f"k.{layer}"] for part in parts]) for layer in layers])
    v = torch.stack([torch.cat([part[f"v.{layer}"] for part in parts]) for layer in layers])
    return k, v


def reorder_all(store: TieredStore, chunk_tokens: int) -> int:
    """One pass over every node with an importance record; the number of nodes rewritten."""
    rewritten = 0
    for key in sorted(store.stored_keys("s.")):
        node = key.removeprefix("s.")
        try:
            rewritten += reorder_node(store, node, chunk_tokens)
        except (StoreUnavailable, CorruptObject) as exc:
            log.warning("node %s was not reordered: %s", node[:16], exc)
    return rewritten


class Reorderer:
    """Runs `reorder_all` every `period` seconds on a thread of its own, until `stop`."""

    def __init__(self, store: TieredStore, chunk_tokens: int, period: float):
        self.store, self.chunk_tokens, self.period = store, chunk_tokens, period
        self.passes = self.nodes_rewritten = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-impress-reorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.period):
            try:
                self.nodes_rewritten += reorder_all(self.store, self.chunk_tokens)
            except Exception:
                log.exception("a reordering pass failed; the next one runs as planned")
            self.passes += 1

    def stop(self) -> None:
        self._stopped.set()
