"""`--prefix-loading impress|h2o-keys`: a request whose prompt begins with chunks of the KV store has its new
tokens prefilled on the store's load thread, layer by layer, reading per layer only what the layer's choice
needs (kv/impress/prefix_prefill.py): IMPRESS reads the probe KV head's keys of every chunk, then K and V of
the chunks holding a chosen token (of every chunk where the probe heads disagree); keys-only H2O reads every
key, then V of the chunks holding a chosen token. A chunk is the unit of a read, so a chosen token costs its
whole chunk's object (read amplification, counted in `ImportantLoadStats`).

The request then joins the scheduler with the prefix and its new tokens' KV preloaded and only its last token
to compute. Under `full`, when part of the prefix is in the device pool already, when a chunk found is stored at
several levels, or when one is gone before its objects are read, the load reads every chunk whole as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

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
    model: torch.nn.Module  # the engine's model: forward(ids, positions, policy, batch)
    device: torch.device


@dataclass
class ImportantLoadStats:
    loads: int = 0  # requests whose prefix was loaded by importance
    layers: int = 0  # layer choices made
    fallbacks: int = 0  # layers that read their whole prefix (IMPRESS's probe heads disagreed)
    bytes_read: int = 0  # every object those loads read, probe keys included
    chunk_reads: int = 0  # (chunk, layer) pairs whose K or V was read
    tokens_offered: int = 0  # prefix tokens x layers
    tokens_read: int = 0  # chosen tokens summed over layers (what attention reads)

    def to_json(self) -> dict:
        return asdict(self)


class StorePrefix:
    """Chunks `found` (consecutive, from token 0, each stored in one form) read object by object."""

    def __init__(self, store: TieredStore, found: list[Located], chunk_tokens: int, method: str):
        self.store, self.found, self.chunk_tokens, self.method = store, found, chunk_tokens, method
        self.num_tokens = len(found) * chunk_tokens
        self.bytes_read = self.chunk_reads = 0
        self._keys: dict[int, torch.Tensor] = {}  # keys-only H2O: a layer's keys, read to score, reused for K

    def _read(self, chunks: list[int], names: list[str]) -> list[torch.Tensor]:
        """Objects `names` of each of `chunks` (one read per chunk), each concatenated over the chunks."""
        parts: list[list[torch.Tensor]] = [[] for _ in names]
        for chunk in chunks:
            got = self.store.read_objects(self.found[chunk], names, self.chunk_tokens)
            if got is None:
                raise ChunkGone(f"chunk {self.found[chunk].key[:16]} no longer holds {names}")
            for part, name in zip(parts, names):
                part.append(got[0][name])
            self.bytes_read += got[1]
        return [torch.cat(part) for part in parts]

    def scoring_keys(self, layer: int) -> torch.Tensor:
        every = list(range(len(self.found)))
        if self.method == "impress":
            return self._read(every, [probe_name(layer)])[0]
        (self._keys[layer],) = self._read(every, [f"k.{layer}"])
        self.chunk_reads += len(every)
        return self._keys[layer]

    def chosen_kv(self, layer: int, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        touched = chosen.view(len(self.found), self.chunk_tokens).any(1)
        chunks = touched.nonzero()[:, 0].tolist()
        in_read = chosen.view(len(self.found), self.chunk_tokens)[touched].flatten()  # chosen among the read rows
        if layer in self._keys:  # keys-only H2O read every key to score
            (v,) = self._read(chunks, [f"v.{layer}"])
            return self._keys.pop(layer)[chosen], v[in_read]
        self.chunk_reads += len(chunks)
        k, v = self._read(chunks, [f"k.{layer}", f"v.{layer}"])
        return k[in_read], v[in_read]


@torch.inference_mode()
def load_important_prefix(loading: ImportantLoading, store: TieredStore, found: list[Located], chunk_tokens: int,
                          token_ids: list[int], stats: ImportantLoadStats) -> PreloadedKV:
    """Prefill `token_ids` after the prefix the chunks `found` hold, reading per layer what the choice needs; the
    KV of the prefix (zeros where a layer did not read) and of the new tokens, with what each layer left unread.
    Raises ChunkGone, and what the store's reads raise."""
    config = loading.model.config
    prefix = StorePrefix(store, found, chunk_tokens, loading.method)
    new = token_ids[prefix.num_tokens :]
    policy = PrefillOverChosenPrefix(prefix, loading.method, loading.ratio, loading.rule, config.num_layers,
                                     (config.num_kv_heads, config.head_dim), len(new), len(new))
    positions = torch.arange(prefix.num_tokens, len(token_ids), device=loading.device)
    loading.model(torch.tensor(new, device=loading.device), positions, policy, None)
    for where in found:
        store.count_hit(where, chunk_tokens)
    decisions = policy.selector.decisions.values()
    stats.loads += 1
    stats.layers += len(decisions)
    stats.fallbacks += sum(d.fallback for d in decisions)
    stats.bytes_read += prefix.bytes_read
    stats.chunk_reads += prefix.chunk_reads
    stats.tokens_offered += prefix.num_tokens * len(decisions)
    stats.tokens_read += sum(int(d.tokens.sum()) for d in decisions)
    return policy.preloaded()
