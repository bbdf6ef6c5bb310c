"""`--kv-offload h2o`: H2O's permanent eviction at a token budget, the baseline InfiniGen is compared with at the
same amount of KV (papers/infinigen.md §1 C1, §4).

Each KV head of each layer keeps, per cached token, the attention it has received so far (summed over the query
heads that share the KV head, over every query since the token arrived, prefill included). At every decode step,
once a sequence holds more live tokens than its budget (`--h2o-budget` of its tokens, at least one), the tokens
with the least accumulated attention are evicted, except the newest half-budget (the recent window); an evicted
token is never attended again, in that layer and head. Prefill attends fully.

The eviction is a mask over the paged cache: the evicted tokens' rows stay allocated, since the point of this
baseline is quality at a given amount of KV. The state is per cache slot, so blocks are not shared between
sequences under h2o (the engine turns prefix caching off).
"""

from __future__ import annotations

import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv.attention_batch import AttentionGroup
from kvstrata.kv.attention_policy import AttentionPolicy
from kvstrata.kv.offload.transfers import OffloadStats
from kvstrata.kv.reference_attention import attend_per_kv_head
from kvstrata.kv.slots import block_slots
from kvstrata.kv.storage import KVStorage

PREFILL_QUERY_SLICE = 256  # prefill queries whose attention weights are materialized at once


class H2OAttention(AttentionPolicy):
    def __init__(self, storage: KVStorage, budget: float, num_slots: int, stats: OffloadStats):
        super().__init__(storage)
        if not 0 < budget <= 1:
            raise KvstrataError(f"h2o_budget {budget!r} must be in (0, 1]")
        self.budget = budget
        self.stats = stats
        shape = (storage.num_layers, storage.kv_shape[0], num_slots)
        self.received = torch.zeros(shape, device=storage.device)  # accumulated attention per (layer, KV head, slot)
        self.evicted = torch.zeros(shape, dtype=torch.bool, device=storage.device)

    def reset_blocks(self, blocks: list[int]) -> None:
        super().reset_blocks(blocks)
        slots = block_slots(torch.tensor(blocks, device=self.received.device), self.storage.block_size)
        self.received[:, :, slots] = 0
        self.evicted[:, :, slots] = False

    def _attend_group(self, layer: int, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        keys = group.keys
        k, v = self.storage.gather_keys(layer, keys, q.dtype)
        k, v = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)  # [kv_heads, n, Tk, D]
        slots = keys.slots
        queries = q.view(group.num_sequences, -1, *q.shape[1:])
        mask = keys.mask_for(group)[None]  # [1, n, Tq, Tk]
        if group.is_decode:
            alive = mask & ~self.evicted[layer][:, slots][:, :, None]  # [kv_heads, n, 1, Tk]
            out, weights = attend_per_kv_head(queries, k, v, alive, with_weights=True)
            self._receive(layer, slots, weights)
            self._evict(layer, group, alive[:, :, 0])
            return out.flatten(0, 1)
        outs = []
        for start in range(0, queries.shape[1], PREFILL_QUERY_SLICE):
            part = slice(start, start + PREFILL_QUERY_SLICE)
            out, weights = attend_per_kv_head(queries[:, part], k, v, mask[:, :, part], with_weights=True)
            self._receive(layer, slots, weights)
            outs.append(out)
        return torch.cat(outs, dim=1).flatten(0, 1)

    def _receive(self, layer: int, slots: torch.Tensor, weights: torch.Tensor) -> None:
        """Add the weights [kv_heads, n, Tq, group, Tk] each key received to its slot's total."""
        received = weights.sum(dim=(2, 3))  # [kv_heads, n, Tk]; padding keys received nothing
        self.received[layer].scatter_add_(1, slots.flatten()[None].expand(received.shape[0], -1), received.flatten(1))

    def _evict(self, layer: int, group: AttentionGroup, alive: torch.Tensor) -> None:
        """Evict, per (KV head, sequence), the least-attended live tokens outside the recent window beyond the
        budget (alive [kv_heads, n, Tk])."""
        keys, contexts = group.keys, group.context_lens
        budget = (self.budget * contexts).floor().long().clamp(min=1)  # [n]
        recent = budget // 2
        live = alive.sum(-1)  # [kv_heads, n]
        excess = (live - budget[None]).clamp(min=0)
        cached = (keys.positions >= 0).sum(-1)  # [n]
        self.stats.decode_rows(layer, fetched=int(live.sum()), cached=int(cached.sum()) * alive.shape[0])
        most = int(excess.max())
        if most == 0:
            return
        candidates = alive & (keys.positions < (contexts - recent)[:, None])[None]
        received = self.received[layer][:, keys.slots].masked_fill(~candidates, float("inf"))
        lowest = received.topk(most, dim=-1, largest=False)  # [kv_heads, n, most]
        victims = lowest.indices
        # the first `excess` of each row, and never a token outside the candidates (when fewer are left)
        chosen = (torch.arange(most, device=victims.device) < excess[..., None]) & lowest.values.isfinite()
        victim_slots = keys.slots[None].expand(alive.shape[0], -1, -1).gather(-1, victims)
        heads = torch.arange(alive.shape[0], device=victims.device)[:, None, None].expand_as(victims)
        self.evicted[layer][heads[chosen], victim_slots[chosen]] = True
