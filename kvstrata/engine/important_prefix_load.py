"""`--prefix-loading impress|h2o-keys`: a request whose prompt begins with chunks of the KV store has its new
tokens prefilled on the store's load thread, layer by layer, reading per layer only what the layer's choice
needs (kv/impress/prefix_prefill.py): IMPRESS reads the probe KV head's keys of every chunk, then K and V of
the chunks holding a chosen token (of every chunk where the probe heads disagree); keys-only H2O reads every
key, then V of the chunks holding a chosen token. A chunk is the unit of a read, so a chosen token costs its
whole chunk's object (read amplification, counted in `ImportantLoadStats`); under `--impress-attend read` (the
default) the layer attends to every token of the chunks it read, since their chunk-mates cost nothing more. A
node of the prefix that was reordered (kv/impress/node_reordering.py) is read through its map: its probe keys
from one sidecar per layer, the chosen tokens from the physical chunks holding them; each IMPRESS load adds its
scores to the running importance the next reordering sorts by. Every object set a load read counts as used,
with the share of its (token, layer) pairs chosen, for the store's eviction policies (kv/store/eviction.py), and
is copied to the tiers above that would keep it.

The request then joins the scheduler with the prefix and its new tokens' KV preloaded and only its last token
to compute. Under `full`, when part of the prefix is in the device pool already, when a chunk found is stored at
several levels, or when one is gone before its objects are read, the load reads every chunk whole as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvstrata.kv.impress.node_reordering import (
    NodeMap,
    node_spans,
    physical_key,
    probes_key,
    read_map,
    record_importance,
)
from kvstrata.kv.impress.prefix_prefill import PrefillOverChosenPrefix
from kvstrata.kv.preloaded import PreloadedKV
from kvstrata.kv.store.tiered_store import Located, TieredStore, probe_name


class ChunkGone(Exception):
    """A chunk the load had found no longer holds an object it needs (evicted meanwhile)."""


@dataclass
class ImportantLoading:
    method: str  # "impress" or "h2o-keys"
    ratio: float  # the share of the prefix each layer's choice keeps (--impress-ratio)
    rule: str  # how IMPRESS merges the probe heads' sets (--impress-rule)
    attend: str  # every token of the chunks a layer read ("read") or only the chosen ones (--impress-attend)
    model: torch.nn.Module  # the engine's model: forward(ids, positions, policy, batch)
    device: torch.device
    reorder_seconds: float = 0.0  # IMPRESS: the period of the store's reordering pass (0: never)


@dataclass
class ImportantLoadStats:
    loads: int = 0  # requests whose prefix was loaded by importance
    layers: int = 0  # layer choices made
    fallbacks: int = 0  # layers that read their whole prefix (IMPRESS's probe heads disagreed)
    bytes_read: int = 0  # every object those loads read, probe keys included
    chunk_reads: int = 0  # (chunk, layer) pairs whose K or V was read
    tokens_offered: int = 0  # prefix tokens x layers
    tokens_chosen: int = 0  # tokens the layers' rule chose, summed over layers
    tokens_read: int = 0  # tokens read and attended, summed over layers (the chosen ones' chunk-mates too)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ObjectSetUse:
    """An object set a load read, for the store's eviction policies: its tokens, and the (token, layer) pairs the
    load chose from it (None: a sidecar of probe keys, read whole to score)."""

    where: Located
    num_tokens: int
    chosen: int | None


class StorePrefix:
    """Chunks `found` (consecutive, from token 0, each stored in one form) read object by object; under IMPRESS,
    a whole node that was reordered (kv/impress/node_reordering.py) is read through its map from its physical
    chunks, where the tokens a layer chooses share fewer chunks."""

    def __init__(self, store: TieredStore, found: list[Located], chunk_tokens: int, method: str):
        self.store, self.found, self.chunk_tokens, self.method = store, found, chunk_tokens, method
        self.num_tokens = len(found) * chunk_tokens
        self.bytes_read = self.chunk_reads = 0
        self.used: dict[str, ObjectSetUse] = {}  # every object set read, by key
        self._keys: dict[int, torch.Tensor] = {}  # keys-only H2O: a layer's keys, read to score, reused for K
        self._probes: list[tuple[Located, dict[str, bytes], int]] | None = None  # IMPRESS: read at the first score
        # Runs of chunks read alike, in order: a reordered node with its (node, map), or logical chunks with None.
        self.segments: list[tuple[range, tuple[str, NodeMap] | None]] = []
        start = 0
        for span in node_spans(len(found)) if method == "impress" else []:
            node = found[span[-1]].key
            node_map = read_map(store, node, len(span) * chunk_tokens)
            if node_map is None:
                continue
            self.bytes_read += node_map.bytes_read
            if start < span.start:
                self.segments.append((range(start, span.start), None))
            self.segments.append((span, (node, node_map)))
            start = span.stop
        if start < len(found):
            self.segments.append((range(start, len(found)), None))

    def _read(self, chunks: list[Located], names: list[str]) -> list[torch.Tensor]:
        """Objects `names` of each of `chunks` (one read per chunk), each concatenated over the chunks (no rows
        for no chunks)."""
        shape = self.store.shape
        parts: list[list[torch.Tensor]] = [[torch.zeros(0, shape.kv_heads, shape.head_dim)] for _ in names]
        for where in chunks:
            got = self.store.read_objects(where, names, self.chunk_tokens)
            if got is None:
                raise ChunkGone(f"chunk {where.key[:16]} no longer holds {names}")
            for part, name in zip(parts, names):
                part.append(got[0][name])
            self.bytes_read += got[1]
            self.used.setdefault(where.key, ObjectSetUse(where, self.chunk_tokens, 0))
        return [torch.cat(part) for part in parts]

    def _chose(self, chunks: list[Located], counts: list[int]) -> None:
        """`counts[i]` tokens of one layer were chosen from chunks[i] (read by `_read`)."""
        for where, count in zip(chunks, counts):
            self.used[where.key].chosen += count

    def scoring_keys(self, layer: int) -> torch.Tensor:
        if self.method == "impress":
            if self._probes is None:
                self._probes = [part for chunks, reordered in self.segments
                                for part in self._read_probes(chunks, reordered)]
            name = probe_name(layer)
            return torch.cat([self.store.decode_read(where, name, objects[name], tokens)
                              for where, objects, tokens in self._probes])
        (self._keys[layer],) = self._read(self.found, [f"k.{layer}"])
        self.chunk_reads += len(self.found)
        return self._keys[layer]

    def _read_probes(self, chunks: range, reordered: tuple[str, NodeMap] | None
                     ) -> list[tuple[Located, dict[str, bytes], int]]:
        """The probe keys of `chunks` in every layer, as stored (each layer's decoded when it scores): from each
        chunk, or from a reordered node's sidecar, in one read each. Every layer scores, so reading them all at
        once reads the same bytes as a read per layer would, in one read where those took one per layer."""
        names = self.store.probe_names
        if reordered is None:
            sources = [(self.found[c], self.chunk_tokens, 0) for c in chunks]
        else:
            sidecar = self._located(probes_key(reordered[0], reordered[1].version))
            sources = [(sidecar, len(chunks) * self.chunk_tokens, None)]
        parts = []
        for where, tokens, chosen in sources:
            fetched = self.store.read(where, names=names)
            if fetched is None:
                raise ChunkGone(f"{where.key[:40]} no longer holds its probe keys")
            self.bytes_read += fetched.num_bytes
            self.used.setdefault(where.key, ObjectSetUse(where, tokens, chosen))
            parts.append((where, fetched.objects, tokens))
        return parts

    def _located(self, key: str) -> Located:
        """Where a reordered node's object set `key` is; ChunkGone if no tier holds it (a later version or an
        eviction removed it)."""
        tier = self.store.locate(key)
        if tier is None:
            raise ChunkGone(f"{key[:40]} is gone")
        return Located(key, tier)

    def read_units(self, layer: int) -> torch.Tensor:
        """Each prefix token's chunk in `layer`: its logical chunk, or in a reordered node the physical chunk holding
        it (numbered from the node's first chunk, so no two chunks read share a number)."""
        units = torch.arange(self.num_tokens) // self.chunk_tokens
        for chunks, reordered in self.segments:
            if reordered is not None:
                tokens = slice(chunks.start * self.chunk_tokens, chunks.stop * self.chunk_tokens)
                units[tokens] = chunks.start + reordered[1].physical[layer] // self.chunk_tokens
        return units

    def chosen_kv(self, layer: int, chosen: torch.Tensor, important: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        important = chosen if important is None else important
        if layer in self._keys:  # keys-only H2O read every key to score
            (v,) = self._chosen_rows(self.found, chosen.view(len(self.found), -1), important, [f"v.{layer}"],
                                     count=False)
            return self._keys.pop(layer)[chosen], v
        names, size, parts = [f"k.{layer}", f"v.{layer}"], self.chunk_tokens, []
        for chunks, reordered in self.segments:
            tokens = slice(chunks.start * size, chunks.stop * size)
            span = chosen[tokens]
            if reordered is None:
                parts.append(self._chosen_rows([self.found[c] for c in chunks], span.view(len(chunks), size),
                                               important[tokens], names))
                continue
            node, node_map = reordered
            physical = node_map.physical[layer]
            positions = physical[span]  # where each chosen token sits, in logical order
            touched = (positions // size).unique()
            located = [self._located(physical_key(node, node_map.version, int(j))) for j in touched]
            rows = torch.searchsorted(touched, positions // size) * size + positions % size
            self.chunk_reads += len(touched)
            k, v = self._read(located, names)
            self._chose(located, (physical[important[tokens]] // size).bincount(minlength=len(span) // size)
                        [touched].tolist())
            parts.append((k[rows], v[rows]))
        return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])

    def _chosen_rows(self, chunks: list[Located], chosen: torch.Tensor, important: torch.Tensor, names: list[str],
                     count: bool = True):
        """Objects `names` of the chosen tokens (`chosen`: a mask [chunks, chunk tokens]), reading each chunk that
        holds one; `important` (a mask over the same tokens, flat) is what the rule chose of them."""
        touched = chosen.any(1)
        if count:
            self.chunk_reads += int(touched.sum())
        read_chunks = [where for where, hit in zip(chunks, touched.tolist()) if hit]
        read = self._read(read_chunks, names)
        self._chose(read_chunks, important.view(chosen.shape)[touched].sum(1).tolist())
        return [x[chosen[touched].flatten()] for x in read]


@torch.inference_mode()
def load_important_prefix(loading: ImportantLoading, store: TieredStore, found: list[Located], chunk_tokens: int,
                          token_ids: list[int], stats: ImportantLoadStats) -> PreloadedKV:
    """Prefill `token_ids` after the prefix the chunks `found` hold, reading per layer what the choice needs; the
    KV of the prefix (zeros where a layer did not read) and of the new tokens, with what each layer left unread.
    Raises ChunkGone, and what the store's reads raise."""
    config = loading.model.config
    prefix = StorePrefix(store, found, chunk_tokens, loading.method)
    new = token_ids[prefix.num_tokens :]
    policy = PrefillOverChosenPrefix(prefix, loading.method, loading.ratio, loading.rule, loading.attend,
                                     config.num_layers, (config.num_kv_heads, config.head_dim), len(new), len(new))
    positions = torch.arange(prefix.num_tokens, len(token_ids), device=loading.device)
    loading.model(torch.tensor(new, device=loading.device), positions, policy, None)
    for where in found:
        store.count_hit(where, chunk_tokens)
    for use in prefix.used.values():
        share = None if use.chosen is None else use.chosen / (use.num_tokens * config.num_layers)
        store.note_use(use.where, use.num_tokens, share)
    if loading.method == "impress":
        _record_importance(store, found, chunk_tokens, policy.selector.token_scores)
    decisions = policy.selector.decisions.values()
    stats.loads += 1
    stats.layers += len(decisions)
    stats.fallbacks += sum(d.fallback for d in decisions)
    stats.bytes_read += prefix.bytes_read
    stats.chunk_reads += prefix.chunk_reads
    stats.tokens_offered += prefix.num_tokens * len(decisions)
    stats.tokens_chosen += sum(int(d.important.sum()) for d in decisions)
    stats.tokens_read += sum(int(d.tokens.sum()) for d in decisions)
    return policy.preloaded()


def _record_importance(store: TieredStore, found: list[Located], chunk_tokens: int,
                       token_scores: dict[int, torch.Tensor]) -> None:
    """Fold this load's scores into the running importance of each whole node of the prefix, on the store's write
    thread (the load does not wait for it)."""
    scores = torch.stack([token_scores[layer] for layer in sorted(token_scores)])  # [layers, prefix tokens]
    for span in node_spans(len(found)):
        keys = [found[chunk].key for chunk in span]
        part = scores[:, span.start * chunk_tokens : span.stop * chunk_tokens].clone()
        store.defer(lambda keys=keys, part=part: record_importance(store, keys[-1], keys, part),
                    2 * part.numel() * part.element_size())
