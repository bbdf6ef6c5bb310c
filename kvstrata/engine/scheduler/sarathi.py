"""SARATHI: chunked prefills and decode-maximal batches (papers/sarathi.md §2.2-2.5).

Every running decode contributes one token; prefill chunks (the ongoing prompts first, then
newly admitted ones) fill the rest of a per-step token budget C. With a tile, the step's token
count is rounded down to a multiple of the tile by shortening the last prefill chunk (§2.4).
"""

from __future__ import annotations

from kvstrata.engine.scheduler.base import Scheduler, SchedulerOutput
from kvstrata.engine.scheduler.policy import FirstComeFirstServed
from kvstrata.engine.sequence import SequenceStatus
from kvstrata.kv.cache_manager import KVCacheManager


class SarathiScheduler(Scheduler):
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, chunk_size: int, tile: int | None = None,
                 policy: str | FirstComeFirstServed = "fcfs"):
        super().__init__(kv, max_num_seqs, policy)
        self.chunk_size = chunk_size
        self.tile = tile

    def _plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_decodes(out)
        for seq in [s for s in self.running if s.num_pending_tokens > 1]:
            budget = self.chunk_size - out.num_tokens
            if budget <= 0:
                break
            num_tokens = min(seq.num_tokens_to_compute, budget)
            if seq.status is SequenceStatus.RUNNING and self._grow_or_preempt(seq, num_tokens, out):
                out.scheduled.append((seq, num_tokens))
        while self.waiting and self._admit(out, self.chunk_size - out.num_tokens, whole=False):
            pass
        self._add_drafts(out, self.chunk_size - out.num_tokens)
        self._align_to_tile(out)
        return out

    def _align_to_tile(self, out: SchedulerOutput) -> None:
        """Shorten the last prefill chunk so the step's token count is a multiple of the tile."""
        if not self.tile or not out.scheduled:
            return
        excess = out.num_tokens % self.tile
        seq, num_tokens = out.scheduled[-1]
        is_prefill = seq.num_pending_tokens > 1
        if excess and is_prefill and num_tokens > excess and out.num_tokens > self.tile:
            out.scheduled[-1] = (seq, num_tokens - excess)
