"""Full attention, except over the prefix tokens a layer never loaded (`--prefix-loading impress|h2o-keys`).

A stored prefix loaded by importance reaches the paged cache whole-sized: each layer's unread tokens are
zeros in their slots, and this policy marks them per (layer, slot), so no step, the request's own decodes or
those of a request that later reuses its blocks from the prefix cache, ever attends to them. A block handed
out for new content is cleared. While no block holds an unread token, every group reads every key, as under
full attention (including the in-place decode readers).
"""

from __future__ import annotations

import torch

from kvstrata.kv.attention_batch import AttentionGroup, CachedKeys
from kvstrata.kv.attention_policy import AttentionPolicy
from kvstrata.kv.preloaded import Preloaded
from kvstrata.kv.slots import block_slots, slots_of_positions
from kvstrata.kv.storage import KVStorage


class SkipUnreadTokens(AttentionPolicy):
    def __init__(self, storage: KVStorage, num_slots: int):
        super().__init__(storage)
        self.unread = torch.zeros(storage.num_layers, num_slots, dtype=torch.bool, device=storage.device)
        self.blocks_with_unread: set[int] = set()

    def reset_blocks(self, blocks: list[int]) -> None:
        super().reset_blocks(blocks)
        cleared = self.blocks_with_unread.intersection(blocks)
        if cleared:
            slots = block_slots(torch.tensor(sorted(cleared), device=self.unread.device), self.storage.block_size)
            self.unread[:, slots] = False
            self.blocks_with_unread.difference_update(cleared)

    def write(self, block_table: list[int], kv: Preloaded, first: int, end: int) -> None:
        super().write(block_table, kv, first, end)
        unread = getattr(kv, "unread", None)
        if unread is None:
            return
        unread = unread[:, first - kv.start : end - kv.start]
        if not bool(unread.any()):
            return
        device, size = self.unread.device, self.storage.block_size
        table = torch.tensor([block_table], dtype=torch.long, device=device)
        slots = slots_of_positions(table, torch.arange(first, end, device=device), size)[0]
        self.unread[:, slots] = unread.to(device)
        self.blocks_with_unread.update(block_table[first // size : -(-end // size)])

    def select_keys(self, layer: int, group: AttentionGroup) -> CachedKeys:
        if not self.blocks_with_unread:
            return group.keys
        keys = group.keys
        columns = torch.arange(keys.width, device=keys.positions.device).expand(group.num_sequences, -1)
        return keys.take(columns, valid=~self.unread[layer][keys.slots])
