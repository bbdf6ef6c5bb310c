"""A cap on InfiniGen's host pool (`--kv-host-memory`, papers/infinigen.md §2.4): when a layer's pool holds more
tokens than fit, a victim policy picks the tokens to give up, and they are never read again in that layer.

Policies (`--kv-host-eviction`):
- `counter` (the paper's): a token's counter grows each time it is fetched; when one reaches 255 every counter of
  the layer halves; the victims are the smallest counters among the older half of the live tokens.
- `lru`: the least recently written or fetched tokens.
- `fifo`: the oldest tokens.

In the paper the new token overwrites the victim's slot. The paged pool here keeps every token in its own slot, so a
victim's slot is marked dead instead: nothing reads it again, its block leaves the prefix-cache index (its content
is no longer whole), and it is cleared when the block is handed out anew. The cap therefore bounds what can be
read, which is what the quality comparison needs; the dead rows are not reused before their block is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.slots import block_slots

COUNTER_LIMIT = 255  # an 8-bit counter


class EvictionPolicy(ABC):
    """Remembers what it needs about each (layer, slot) and picks victims among a layer's live slots."""

    def __init__(self, num_layers: int, num_slots: int, device: torch.device):
        self.arrival = torch.zeros(num_layers, num_slots, dtype=torch.long, device=device)
        self._clock = 0

    def written(self, layer: int, slots: torch.Tensor) -> None:
        self.arrival[layer, slots] = self._tick(len(slots))

    def fetched(self, layer: int, slots: torch.Tensor) -> None:
        """`slots` (distinct) were read by this layer's attention."""

    def _tick(self, count: int) -> torch.Tensor:
        ticks = torch.arange(self._clock, self._clock + count, device=self.arrival.device)
        self._clock += count
        return ticks

    @abstractmethod
    def victims(self, layer: int, live: torch.Tensor, count: int) -> torch.Tensor:
        """`count` slots of `live` (bool [slots]) to give up."""


class FifoEviction(EvictionPolicy):
    def victims(self, layer, live, count):
        return _smallest(self.arrival[layer], live, count)


class LruEviction(EvictionPolicy):
    def __init__(self, num_layers, num_slots, device):
        super().__init__(num_layers, num_slots, device)
        self.last_use = torch.zeros_like(self.arrival)

    def written(self, layer, slots):
        super().written(layer, slots)
        self.last_use[layer, slots] = self.arrival[layer, slots]

    def fetched(self, layer, slots):
        self.last_use[layer, slots] = self._tick(len(slots))

    def victims(self, layer, live, count):
        return _smallest(self.last_use[layer], live, count)


class CounterEviction(EvictionPolicy):
    def __init__(self, num_layers, num_slots, device):
        super().__init__(num_layers, num_slots, device)
        self.counters = torch.zeros(num_layers, num_slots, dtype=torch.int16, device=device)

    def written(self, layer, slots):
        super().written(layer, slots)
        self.counters[layer, slots] = 0

    def fetched(self, layer, slots):
        counters = self.counters[layer]
        counters[slots] += 1
        if len(slots) and int(counters[slots].max()) >= COUNTER_LIMIT:
            counters //= 2

    def victims(self, layer, live, count):
        # the older half of the live tokens (at least `count` of them), then the smallest counters among them
        older = _smallest(self.arrival[layer], live, max(count, int(live.sum()) // 2))
        candidates = torch.zeros_like(live)
        candidates[older] = True
        return _smallest(self.counters[layer].long(), candidates, count)


def _smallest(values: torch.Tensor, among: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` slots of `among` with the smallest `values` (ties: the lower slot)."""
    masked = values.masked_fill(~among, torch.iinfo(values.dtype).max)
    return masked.topk(count, largest=False, sorted=False).indices


EVICTION_POLICIES = {"counter": CounterEviction, "lru": LruEviction, "fifo": FifoEviction}


class HostPoolCap:
    """At most `capacity` live tokens per layer in the host pool."""

    def __init__(self, capacity: int, policy: str, num_layers: int, num_slots: int, block_size: int,
                 device: torch.device):
        if capacity < 1:
            raise KvstrataError(f"kv_host_memory holds {capacity} tokens; it must hold at least one")
        if policy not in EVICTION_POLICIES:
            raise KvstrataError(f"kv_host_eviction {policy!r} is not one of {', '.join(EVICTION_POLICIES)}")
        self.capacity = capacity
        self.block_size = block_size
        self.policy = EVICTION_POLICIES[policy](num_layers, num_slots, device)
        self.live = torch.zeros(num_layers, num_slots, dtype=torch.bool, device=device)
        self.dead = torch.zeros_like(self.live)  # given up; never read again until its block is handed out anew
        self.evictions = 0
        self.pool: BlockPool | None = None
        self._holding: torch.Tensor | None = None  # per slot: its block holds content (in use or cached)

    def attach_block_pool(self, pool: BlockPool) -> None:
        self.pool = pool

    def begin_step(self) -> None:
        self._holding = None

    def reset_blocks(self, blocks: list[int]) -> None:
        slots = block_slots(torch.tensor(blocks, device=self.live.device), self.block_size)
        self.live[:, slots] = False
        self.dead[:, slots] = False

    def stored(self, layer: int, slots: torch.Tensor) -> None:
        """New tokens of `layer` are in the pool; give up tokens beyond the capacity."""
        self.live[layer, slots] = True
        self.policy.written(layer, slots)
        live = self.live[layer] & self._holding_slots()
        excess = int(live.sum()) - self.capacity
        if excess > 0:
            victims = self.policy.victims(layer, live, excess)
            self.live[layer, victims] = False
            self.dead[layer, victims] = True
            self.evictions += excess
            if self.pool is not None:
                for block in (victims // self.block_size).unique().tolist():
                    self.pool.forget(block)

    def fetched(self, layer: int, slots: torch.Tensor) -> None:
        """`slots` (distinct) were copied out of the pool for `layer`."""
        self.policy.fetched(layer, slots)

    def _holding_slots(self) -> torch.Tensor:
        if self._holding is None:
            pool = self.pool
            holding = torch.ones(self.live.shape[1] // self.block_size, dtype=torch.bool, device=self.live.device)
            if pool is not None:
                holding = torch.tensor([count > 0 or cached is not None
                                        for count, cached in zip(pool.ref_counts, pool.hash_of_block)],
                                       device=self.live.device)
            self._holding = holding.repeat_interleave(self.block_size)
        return self._holding
