"""A block pool whose blocks also form aligned groups that a storage can borrow whole.

KIVI keeps its newest tokens in float16: one block's float16 K (or V) rows take the memory of the 4-bit codes of
four blocks (2-bit: eight), so its window lives in groups of the pool's own blocks, lent as they are needed, and the
KV budget holds quantized blocks and window alike (kv/kivi_cache.py). A group can be lent only while none of its
blocks is held, so the pool hands out blocks of groups that already hold some before it opens a whole group: the
blocks that requests hold stay packed, and whole groups stay free to lend. A free block in such a group is handed
out even if it caches a prefix while an empty one lies elsewhere; the least recently used order of the other free
blocks is kept.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from kvstrata.kv.block_pool import BlockPool


class GroupBorrower(Protocol):
    """Storage that keeps state in groups the pool lends (KIVI's window): the cache manager has what the running
    sequences may need lent before a step, so a step never runs short."""

    group_size: int  # blocks a group holds

    def groups_for(self, num_blocks: int) -> int:
        """Groups a sequence of `num_blocks` blocks may hold at once."""

    def reserve(self, groups: int, keep_free: int) -> bool:
        """Have `groups` lent for the running sequences (and what any step adds), leaving `keep_free` blocks free
        (spare lent groups go back where the pool is short of them); False where the pool cannot."""

    def give_back_spare(self, groups: int) -> None:
        """Return lent groups that hold nothing, beyond `groups` (and what any step adds)."""


class GroupedBlockPool(BlockPool):
    def __init__(self, num_blocks: int, group_size: int):
        if group_size < 1 or num_blocks % group_size:
            raise ValueError(f"{num_blocks} blocks do not form groups of {group_size}")
        super().__init__(num_blocks)
        self.group_size = group_size
        self.held_in_group = [0] * (num_blocks // group_size)  # blocks of each group that are held or lent
        self.free_in_partial_groups: set[int] = set()  # free blocks of groups that hold some: handed out first
        self.lent: set[int] = set()  # groups lent whole
        # Groups that held no block when queued, highest first (negated for heapq); an entry may have gone stale
        # since, and is checked when it comes up. `queued` keeps a group in the heap once, so it stays this size.
        self.empty_groups = [-group for group in range(len(self.held_in_group))]
        heapq.heapify(self.empty_groups)
        self.queued = set(range(len(self.held_in_group)))

    def _blocks_of(self, group: int) -> range:
        return range(group * self.group_size, (group + 1) * self.group_size)

    def _pick_free(self) -> int:
        if not self.free_in_partial_groups:
            return super()._pick_free()
        block = self.free_in_partial_groups.pop()
        del self.free[block]
        return block

    def _became_held(self, block: int) -> None:
        group = block // self.group_size
        self.free_in_partial_groups.discard(block)
        self.held_in_group[group] += 1
        if self.held_in_group[group] == 1:
            self.free_in_partial_groups.update(b for b in self._blocks_of(group) if b in self.free)

    def _became_free(self, block: int) -> None:
        group = block // self.group_size
        self.held_in_group[group] -= 1
        if self.held_in_group[group]:
            self.free_in_partial_groups.add(block)
        else:
            self.free_in_partial_groups.difference_update(self._blocks_of(group))
            self._queue_empty(group)

    def _queue_empty(self, group: int) -> None:
        if group not in self.queued:
            self.queued.add(group)
            heapq.heappush(self.empty_groups, -group)

    def lend_group(self) -> int | None:
        """Lend a group none of whose blocks is held, the highest such (what its blocks cached is evicted); None
        where every group holds a block."""
        group = None
        while self.empty_groups and group is None:
            candidate = -heapq.heappop(self.empty_groups)
            self.queued.discard(candidate)
            if not self.held_in_group[candidate]:
                group = candidate
        if group is None:
            return None
        for block in self._blocks_of(group):
            del self.free[block]
            self._evict(block)
            self.ref_counts[block] = 1
        self.held_in_group[group] = self.group_size
        self.lent.add(group)
        return group

    def take_back_group(self, group: int) -> None:
        """A lent group's blocks are free again, holding nothing."""
        self.lent.remove(group)
        for block in self._blocks_of(group):
            self.ref_counts[block] = 0
            self.free[block] = None
            self.free.move_to_end(block, last=False)
        self.held_in_group[group] = 0
        self._queue_empty(group)
