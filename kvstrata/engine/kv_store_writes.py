"""The KV store's writes (kv_store_link.py holds the loads): the chunks a prefill computed are copied out of the
paged cache while their request holds its blocks, then encoded and written to every tier on one background thread,
so a step never waits on the store. Promotions of chunks a load found in a lower tier go the same way.

Snapshots waiting to be written are bounded (MAX_PENDING_WRITE_BYTES): beyond that, chunks are skipped and
counted, as is a write that fails. Requests whose KV came from a saved context (they carry a salt) are not
written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kvstrata.engine.torch_threads import use_torch_threads
from kvstrata.kv.storage import KVStorage
from kvstrata.kv.store.tiered_store import TieredStore

log = logging.getLogger("kvstrata.kv.store")
MAX_PENDING_WRITE_BYTES = 512 * 2**20  # snapshots waiting to be written; beyond this, writes are skipped


class StoreWrites:
    def __init__(self, store: TieredStore, chunk_tokens: int, kv_cache: KVStorage, stats,
                 chunk_keys: Callable[[list[int], int, bytes], list[str]]):
        """`stats`: the link's LinkStats (chunks_queued, writes_skipped); `chunk_keys`: the keys of a token
        sequence's first n chunks in a salt's chain."""
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.kv_cache = kv_cache
        self.stats = stats
        self.chunk_keys = chunk_keys
        store.defer = self.defer
        # Encoding runs many small torch ops per object: off the main thread it runs best on one torch thread.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-store-write",
                                          initializer=use_torch_threads, initargs=(1,))
        self._pending_bytes = 0
        self._lock = threading.Lock()

    def store_prompt(self, seq, reused_tokens: int) -> None:
        """Queue the full chunks of `seq`'s prompt that its prefill computed (those ending after the first
        `reused_tokens`, which came from the device pool or the store) for writing. The KV is copied now,
        while `seq` holds its blocks; encoding and writing happen on the write thread. A chunk that reaches into
        blocks `seq` never held (a prefix matched behind a sliding window) is not written."""
        if seq.store_salt is None:
            return
        num_chunks = seq.num_prompt_tokens // self.chunk_tokens
        first = max(reused_tokens // self.chunk_tokens,
                    -(-seq.num_released_blocks * self.kv_cache.block_size // self.chunk_tokens))
        if first >= num_chunks:
            return
        shape = self.store.shape
        chunk_bytes = 2 * shape.num_layers * self.chunk_tokens * shape.kv_heads * shape.head_dim * 4  # float32 K, V
        with self._lock:  # as many chunks as the backlog has room for, sized before anything is copied
            fitting = min(num_chunks - first, (MAX_PENDING_WRITE_BYTES - self._pending_bytes) // chunk_bytes)
            self._pending_bytes += max(fitting, 0) * chunk_bytes
            self.stats.writes_skipped += num_chunks - first - max(fitting, 0)
        if fitting <= 0:
            return
        end = first + fitting
        size = fitting * chunk_bytes
        try:
            k, v = self._read(seq.block_table, first * self.chunk_tokens, end * self.chunk_tokens)
        except Exception:
            log.exception("request %s: its prompt's KV could not be read for the store", seq.request_id)
            with self._lock:
                self.stats.writes_skipped += fitting
            self._release(size)
            return
        self.stats.chunks_queued += fitting
        keys = self.chunk_keys(seq.token_ids, end, seq.store_salt)[first:]
        self._thread.submit(self._write, keys, first * self.chunk_tokens, k, v, size)

    def _read(self, block_table: list[int], first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, end - first, kv_heads, head_dim] of one sequence's tokens, as float32 on the CPU."""
        layers = [self.kv_cache.read(layer, block_table, end, first) for layer in range(self.kv_cache.num_layers)]
        return torch.stack([k.cpu() for k, _ in layers]), torch.stack([v.cpu() for _, v in layers])

    def _write(self, keys: list[str], position: int, k: torch.Tensor, v: torch.Tensor, size: int) -> None:
        """On the write thread: each chunk to every tier that lacks it (the first one's first token at `position`)."""
        try:
            for index, key in enumerate(keys):
                span = slice(index * self.chunk_tokens, (index + 1) * self.chunk_tokens)
                self.store.put(key, k[:, span], v[:, span], position=position + span.start)
        except Exception:
            log.exception("writing chunks to the KV store failed; they are skipped")
        finally:
            self._release(size)

    def _release(self, size: int) -> None:
        with self._lock:
            self._pending_bytes -= size

    def defer(self, work, size: int) -> None:
        """Store work a load need not wait for (promoting a hit to the tiers above) goes to the write thread, within
        the same backlog as writes; beyond it, the work is dropped (the chunk stays where it was found)."""
        with self._lock:
            if self._pending_bytes + size > MAX_PENDING_WRITE_BYTES:
                self.stats.writes_skipped += 1
                return
            self._pending_bytes += size

        def run() -> None:
            try:
                work()
            except Exception:
                log.exception("promoting a chunk in the KV store failed; it stays where it was")
            finally:
                self._release(size)

        self._thread.submit(run)

    def flush(self) -> None:
        """Wait until every queued write is done (tests, tools, shutdown)."""
        self._thread.submit(lambda: None).result()

    def close(self) -> None:
        """Let the queued writes finish."""
        self._thread.shutdown(wait=True)
