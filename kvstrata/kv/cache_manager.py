"""Gives sequences their KV blocks: prefix-cache matching, growth, placing preloaded KV, release.

The KV store below the device pool is asked by the engine, before a request is scheduled and in the
background (engine/kv_store_link.py); what it finds arrives here as preloaded KV."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvstrata.errors import RequestFailed
from kvstrata.kv.block_groups import GroupBorrower, GroupedBlockPool
from kvstrata.kv.block_hash import BlockHash, full_block_hashes
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.preloaded import Preloaded
from kvstrata.kv.window_blocks import blocks_behind, blocks_behind_prefix, longest_readable_prefix


class Sequence(Protocol):
    """What the cache manager reads and writes of a request (engine/sequence.py has the whole of it)."""

    request_id: str
    token_ids: list[int]
    block_table: list[int]
    num_released_blocks: int
    block_hashes: list[BlockHash]
    num_computed_tokens: int
    cache_salt: bytes | None
    preloaded: list[Preloaded]
    num_preloaded_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def reads_cached_prefix(self) -> bool: ...


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_allocate: Callable[[list[int]], None] | None = None,
        write_kv: Callable[[list[int], Preloaded, int, int], None] | None = None,
        namespace: bytes = b"",
        window: int | None = None,
        borrower: GroupBorrower | None = None,
    ):
        # A storage that borrows groups of blocks (KIVI's window) has them lent as sequences grow, counted here
        self.pool = BlockPool(num_blocks) if borrower is None else GroupedBlockPool(num_blocks, borrower.group_size)
        self.borrower = borrower
        self._groups_of: dict[int, int] = {}  # id of a sequence -> the groups it may hold (`borrower`)
        self._groups_wanted = 0  # their sum over the sequences that hold blocks
        # A sliding window: a query reads only the keys of its last `window` positions, so the blocks before
        # them go back to the pool (release_behind_window). None: every key stays readable.
        self.window = window
        # Block hashes name the model and KV format too: blocks of other weights or another format never match.
        self.namespace = namespace
        self.on_allocate = on_allocate  # told of blocks handed out for new content (the cache resets them)
        self.write_kv = write_kv  # (block_table, preloaded KV, first, end): stores given KV in a sequence's blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence."""
        return self.pool.num_used / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_root(self, seq: Sequence) -> bytes:
        """Where a sequence's hash chain starts: the namespace, and the salt of KV given ready-made."""
        return self.namespace + (seq.cache_salt or b"")

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq`'s longest prefix that the device pool holds now (under a sliding window: the part of it
        that the next query reads), without taking its blocks."""
        return self._cached_blocks(seq)[0] * self.block_size

    def _cached_blocks(self, seq: Sequence) -> tuple[int, int]:
        """How many leading blocks of `seq` count as cached (all of them in the pool, or under a sliding window
        those that the query after them reads), and how many it could use (all full blocks before its last token,
        whose logits must be computed)."""
        if not self.enable_prefix_caching:
            return 0, 0
        if len(seq.block_hashes) < seq.num_tokens // self.block_size:  # hashed once per block, not once per step
            seq.block_hashes = full_block_hashes(seq.token_ids, self.block_size, seq.block_hashes, self.hash_root(seq))
        if not seq.reads_cached_prefix:
            return 0, 0  # it computes every prompt token (its blocks are cached for others all the same)
        usable = (seq.num_tokens - 1) // self.block_size
        held = (self.pool.lookup(block_hash) is not None for block_hash in seq.block_hashes[:usable])
        return longest_readable_prefix(held, self.block_size, self.window), usable

    def prompt_blocks_ahead(self, running: list[Sequence]) -> set[BlockHash]:
        """Hashes of the full blocks that `running` sequences have yet to compute (those of this step included)."""
        if not self.enable_prefix_caching:
            return set()
        ahead = set()
        for seq in running:
            ahead.update(seq.block_hashes[seq.num_computed_tokens // self.block_size :])
        return ahead

    def waits_for(self, seq: Sequence, ahead: set[BlockHash]) -> bool:
        """Whether `seq` should wait for other sequences to compute blocks it shares with them (`ahead`), then
        read them from the prefix cache: when the blocks after its cached prefix are among them, and they are
        at least as many tokens as it would compute alone after them. Waiting then costs about the time that
        computing them itself would, and saves the work; a short shared head (a one-block system prompt before
        a long question) is not worth a step's wait."""
        if not ahead:
            return False
        held, usable = self._cached_blocks(seq)
        shared = held
        while shared < usable and seq.block_hashes[shared] in ahead:
            shared += 1
        shared_tokens = (shared - held) * self.block_size
        return shared_tokens > 0 and shared_tokens >= seq.num_tokens - shared * self.block_size

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks of the longest prefix the device pool holds; return the tokens it covers.

        Under a sliding window the prefix counts as cached where the blocks its next query reads are, whatever
        became of those before them: only those are attached, and the others are entries given back behind the
        window from the start (release_behind_window). So a prefix stays usable after the pool handed out its
        head, which goes back to the pool first, as its sequence moves past it. At least one token is always left
        to compute, since its logits give the next token.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        cached, _ = self._cached_blocks(seq)
        behind = blocks_behind_prefix(cached, self.block_size, self.window)
        for block_hash in seq.block_hashes[behind:cached]:
            block = self.pool.lookup(block_hash)
            self.pool.share(block)
            seq.block_table.append(block)
        seq.block_table[:0] = seq.block_table[:1] * behind
        seq.num_released_blocks = behind
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq` (and for the groups its storage may borrow for it);
        False (and no change to `seq`) if the pool is short."""
        blocks = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        extra = blocks - len(seq.block_table)
        if self.borrower is not None:
            groups = self.borrower.groups_for(blocks)
            wanted = self._groups_wanted - self._groups_of.get(id(seq), 0) + groups
            if not self.borrower.reserve(wanted, keep_free=extra):
                return False
        if extra > self.pool.num_free:
            return False
        if self.borrower is not None:
            self._groups_of[id(seq)], self._groups_wanted = groups, wanted
        while len(seq.block_table) < blocks:
            seq.block_table.append(self.pool.allocate())
        allocated = self.pool.drain_allocations()
        if allocated and self.on_allocate is not None:
            self.on_allocate(allocated)
        return True

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """Index the blocks that the last step's `num_new_tokens` filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        first = (seq.num_computed_tokens - num_new_tokens) // self.block_size
        full = seq.num_computed_tokens // self.block_size
        if full > len(seq.block_hashes):
            seq.block_hashes = full_block_hashes(
                seq.token_ids[: full * self.block_size], self.block_size, seq.block_hashes, self.hash_root(seq)
            )
        for index in range(first, full):
            self.pool.register(seq.block_table[index], seq.block_hashes[index])

    def place_preloaded(self, seq: Sequence) -> bool:
        """Store the preloaded KV that continues `seq` from its computed tokens, as if it had been computed.

        Stops at the first gap (a text chunk to recompute) and before the last token, whose logits
        are needed. False if the pool is short of blocks; the caller frees or preempts `seq`.
        """
        for segment in seq.preloaded:
            start = seq.num_computed_tokens
            end = min(segment.end, seq.num_tokens - 1)
            if not segment.start <= start < end:
                continue
            if not self.grow(seq, end - start):
                return False
            try:
                self.write_kv(seq.block_table, segment, start, end)
            except Exception as exc:  # a corrupt file, a failed fetch: this request's problem alone
                raise RequestFailed(seq.request_id, f"its preloaded KV for tokens [{start}, {end}) could not be "
                                                    f"stored: {exc}") from exc
            seq.num_computed_tokens = end
            seq.num_preloaded_tokens += end - start
            self.commit(seq, end - start)
        return True

    def release_behind_window(self, seq: Sequence) -> None:
        """Under a sliding window, give back the leading blocks of `seq` that none of its later queries reads (the
        next one is at position `num_computed_tokens` and reads from `window` - 1 positions before it). Their
        table entries then repeat the first block kept, so a padded read stays in memory `seq` holds; the blocks
        stay in the prefix cache until the pool hands them out again."""
        # a window shorter than a block keeps the block written
        behind = min(blocks_behind(seq.num_computed_tokens, self.block_size, self.window), len(seq.block_table) - 1)
        if behind <= seq.num_released_blocks:
            return
        for block in seq.block_table[seq.num_released_blocks : behind]:
            self.pool.release(block)
        seq.block_table[:behind] = [seq.block_table[behind]] * behind
        seq.num_released_blocks = behind

    def held_blocks(self, seq: Sequence) -> list[int]:
        """The blocks `seq` holds a reference to: its table less the entries released behind a window."""
        return seq.block_table[seq.num_released_blocks :]

    def blocks_freed_by(self, seqs: list[Sequence]) -> int:
        """Blocks that freeing every one of `seqs` would return to the pool: those no other sequence holds."""
        held = Counter(block for seq in seqs for block in self.held_blocks(seq))
        return sum(1 for block, count in held.items() if self.pool.ref_counts[block] == count)

    def discard(self, seq: Sequence) -> None:
        """Free a failed sequence's blocks and take those only it held out of the prefix cache: what it
        wrote may be corrupt (a bad preloaded context) and must not be served to another request."""
        for block in self.held_blocks(seq):
            if self.pool.ref_counts[block] == 1:
                self.pool.forget(block)
        for block_hash in seq.block_hashes[: seq.num_released_blocks]:  # given back behind a window, still cached
            block = self.pool.lookup(block_hash)
            if block is not None and self.pool.ref_counts[block] == 0:
                self.pool.forget(block)
        self.free(seq)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; the tail goes first, so shared heads stay cached longest."""
        self._groups_wanted -= self._groups_of.pop(id(seq), 0)
        for block in reversed(self.held_blocks(seq)):
            self.pool.release(block)
        if self.borrower is not None:
            self.borrower.give_back_spare(self._groups_wanted)
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.num_computed_tokens = 0
