"""What the device pool's prefix cache holds, as a stream of events another process can follow (vLLM's KV
cache events): a block's hash became findable, or stopped being findable. A router that reads the stream
knows which blocks each replica holds now, instead of guessing from where it sent earlier requests.

The engine thread appends; a reader in another thread asks for everything after its cursor. A reader
that fell behind the kept events, or holds a cursor from another log (the replica restarted), gets the
whole picture instead: a snapshot of every hash held now, marked as replacing what it knew.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from dataclasses import dataclass

from kvstrata.kv.block_hash import BlockHash

KEPT_EVENTS = 100_000  # about 11 MB: a reader polling every 0.5 s falls this far behind at 200,000 changes a second


@dataclass(frozen=True)
class KVEvents:
    """A reader's news: `stored` and `removed` in the order they happened ((True, hash) stored, (False, hash)
    removed); with `snapshot`, forget what was known first (the pairs then list every hash held now)."""

    log_id: str  # the log they came from: a new one after the engine restarted
    cursor: int  # pass it back to get what follows
    changes: list[tuple[bool, BlockHash]]
    snapshot: bool


class KVEventLog:
    def __init__(self, kept_events: int = KEPT_EVENTS):
        self.log_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._changes: deque[tuple[bool, BlockHash]] = deque(maxlen=kept_events)
        self._next = 0  # the cursor after the newest change
        self._held: set[BlockHash] = set()  # what a snapshot lists

    def stored(self, block_hash: BlockHash) -> None:
        self._append(True, block_hash)

    def removed(self, block_hash: BlockHash) -> None:
        self._append(False, block_hash)

    def _append(self, stored: bool, block_hash: BlockHash) -> None:
        with self._lock:
            self._changes.append((stored, block_hash))
            self._next += 1
            if stored:
                self._held.add(block_hash)
            else:
                self._held.discard(block_hash)

    def since(self, log_id: str | None, cursor: int) -> KVEvents:
        """The changes after `cursor` of log `log_id`; a snapshot if that is not this log or no longer kept."""
        with self._lock:
            oldest = self._next - len(self._changes)
            if log_id != self.log_id or not oldest <= cursor <= self._next:
                return KVEvents(self.log_id, self._next, [(True, h) for h in self._held], snapshot=True)
            changes = list(itertools.islice(self._changes, cursor - oldest, None))
            return KVEvents(self.log_id, self._next, changes, snapshot=False)
