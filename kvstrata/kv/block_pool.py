"""A fixed pool of KV blocks: reference counts, a prefix-cache index and LRU eviction.

A block with no references is free. A free block that still holds a cached prefix (it has a
hash) can be claimed back by a later request until it is evicted; blocks are evicted least
recently used first, and blocks holding nothing cached are handed out before any cached one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvstrata.kv.block_hash import BlockHash
from kvstrata.kv.kv_events import KVEventLog

EvictionListener = Callable[[int, BlockHash], None]


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: list[BlockHash | None] = [None] * num_blocks
        self.block_of_hash: dict[BlockHash, int] = {}
        # Free blocks, the next one to hand out first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.allocations: list[int] = []  # blocks handed out for new content, until drained
        # Told (block, its hash) when a cached block is about to be reused: its content is still intact
        # during the call, so a lower tier can copy it.
        self.eviction_listeners: list[EvictionListener] = []
        self.events: KVEventLog | None = None  # told every hash that becomes findable or stops being so

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        """Take a free block (evicting whatever prefix it cached); the caller checked `num_free`."""
        block = self._pick_free()
        self.allocations.append(block)
        self._evict(block)
        self.ref_counts[block] = 1
        self._became_held(block)
        return block

    def _pick_free(self) -> int:
        """Take the next free block out of `free`."""
        block, _ = self.free.popitem(last=False)
        return block

    def _evict(self, block: int) -> None:
        """Drop what a block taken from `free` cached, telling the listeners first."""
        cached = self.hash_of_block[block]
        if cached is not None:
            for listener in self.eviction_listeners:
                listener(block, cached)
            self.forget(block)

    def _became_held(self, block: int) -> None:
        """A free block gained its first reference (block_groups.py follows this)."""

    def _became_free(self, block: int) -> None:
        """A block lost its last reference."""

    def drain_allocations(self) -> list[int]:
        """Blocks handed out since the last call: whatever they held before is stale."""
        blocks, self.allocations = self.allocations, []
        return blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.block_of_hash.get(block_hash)

    def share(self, block: int) -> None:
        """Add a reference to a cached block found by `lookup`."""
        self.ref_counts[block] += 1
        if self.ref_counts[block] == 1:
            del self.free[block]
            self._became_held(block)

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.hash_of_block[block] is None:
                self.free.move_to_end(block, last=False)
            self._became_free(block)

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Index a full block by its chained hash, unless an identical block is already indexed."""
        if self.hash_of_block[block] is None and block_hash not in self.block_of_hash:
            self.block_of_hash[block_hash] = block
            self.hash_of_block[block] = block_hash
            if self.events is not None:
                self.events.stored(block_hash)

    def forget_free(self) -> int:
        """Take every free block out of the prefix-cache index (blocks a request holds keep theirs); how many."""
        cached = [block for block in self.free if self.hash_of_block[block] is not None]
        for block in cached:
            self.forget(block)
            self.free.move_to_end(block, last=False)
        return len(cached)

    def forget(self, block: int) -> None:
        """Take a block out of the prefix-cache index: no later request will find its content."""
        cached = self.hash_of_block[block]
        if cached is not None:
            del self.block_of_hash[cached]
            self.hash_of_block[block] = None
            if self.events is not None:
                self.events.removed(cached)
