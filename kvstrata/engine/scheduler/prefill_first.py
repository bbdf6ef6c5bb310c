"""Baselines from before SARATHI, on the same engine (papers/sarathi.md §2.1).

`PrefillFirstScheduler`: iteration-level batching as in Orca / vLLM's original scheduler.
Waiting prompts are admitted whole whenever they fit; a step with prefills runs only prefills,
so running decodes stall behind it.

`StaticScheduler`: request-level batching. A batch is admitted at once and runs until every
member finishes; only then is the next batch admitted. A member preempted for lack of KV
blocks goes back to the waiting queue (its front, under fcfs) and joins a later batch.
"""

from __future__ import annotations

from kvstrata.engine.scheduler.base import Scheduler, SchedulerOutput
from kvstrata.engine.scheduler.policy import FirstComeFirstServed
from kvstrata.engine.sequence import SequenceStatus
from kvstrata.kv.cache_manager import KVCacheManager


class PrefillFirstScheduler(Scheduler):
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_prefill_tokens: int | None,
                 policy: str | FirstComeFirstServed = "fcfs"):
        super().__init__(kv, max_num_seqs, policy)
        self.max_prefill_tokens = max_prefill_tokens

    def may_admit(self) -> bool:
        return True

    def _plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._continue_prompts(out)
        if self.waiting and self.may_admit():
            budget = None if self.max_prefill_tokens is None else self.max_prefill_tokens - out.num_tokens
            while self.waiting and (budget is None or budget > 0) and self._admit(out, budget, whole=True):
                if budget is not None:
                    budget -= out.scheduled[-1][1]
        if out.scheduled:
            return out
        self._schedule_decodes(out)
        self._add_drafts(out, None)
        return out

    def _continue_prompts(self, out: SchedulerOutput) -> None:
        """Running prompts that paused where preloaded KV was placed: their next text, whole."""
        for seq in [s for s in self.running if s.num_pending_tokens > 1]:
            if seq.status is SequenceStatus.RUNNING and self._grow_or_preempt(seq, seq.num_tokens_to_compute, out):
                out.scheduled.append((seq, seq.num_tokens_to_compute))


class StaticScheduler(PrefillFirstScheduler):
    # Request-level batching admits a batch at once: a member that waited a step for a shared prefix would
    # wait for the whole batch instead.
    shares_prefixes_in_flight = False

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, policy: str | FirstComeFirstServed = "fcfs"):
        super().__init__(kv, max_num_seqs, max_prefill_tokens=None, policy=policy)

    def may_admit(self) -> bool:
        return not self.running
