"""What every scheduler shares: the queues, admission with prefix caching, decode slots, preemption.

A scheduler only decides which tokens of which sequences run in the next step; the engine runs
them. Preemption is by recompute: a preempted sequence gives back its blocks, returns to the
waiting queue (at the front, or in its priority's place: policy.py) and is prefilled again (often
from the prefix cache) when it resumes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstrata.engine.scheduler.policy import FirstComeFirstServed, scheduling_policy
from kvstrata.engine.sequence import Sequence, SequenceStatus
from kvstrata.kv.cache_manager import KVCacheManager


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler(ABC):
    shares_prefixes_in_flight = True  # see _next_to_admit
    # speculative decoding: the tokens guessed to follow a decoding sequence's last one (the engine sets it)
    propose_drafts: Callable[[Sequence], list[int]] | None = None

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, policy: str | FirstComeFirstServed = "fcfs"):
        """`policy`: a scheduling policy, or its name (with its defaults)."""
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.policy = scheduling_policy(policy) if isinstance(policy, str) else policy
        self.waiting: deque[Sequence] = deque()  # in the policy's order, as `running` is
        self.running: list[Sequence] = []

    def schedule(self) -> SchedulerOutput:
        """The next step's tokens; the waiting are first put in the policy's order for what the pool holds now."""
        self.policy.order(self.waiting, self.kv)
        return self._plan()

    @abstractmethod
    def _plan(self) -> SchedulerOutput: ...

    def add(self, seq: Sequence) -> None:
        self.policy.enqueue(self.waiting, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def _admit(self, out: SchedulerOutput, token_budget: int | None, whole: bool) -> bool:
        """Move the first waiting sequence that need not wait (`_next_to_admit`) to running, scheduling up to
        `token_budget` of its tokens; short of KV blocks or of room in the batch, it preempts running sequences
        the policy ranks below it, worst first, until it fits (where preempting them all could make room).

        `whole` demands all its pending tokens in this step. False when it does not fit.
        """
        if token_budget is not None and token_budget <= 0:
            return False
        if len(self.running) >= self.max_num_seqs and not self.policy.preempts_for_admission:
            return False
        seq = self._next_to_admit(out)
        if seq is None:
            return False
        while True:
            fits = self._try_admit(seq, out, token_budget, whole)
            if fits is not None:
                return fits
            if not self.policy.preempts_for_admission or not self._could_make_room(seq, token_budget):
                return False
            self._preempt_in_step(self.running[-1], out)  # the worst: one the policy ranks below `seq`

    def _try_admit(self, seq: Sequence, out: SchedulerOutput, token_budget: int | None, whole: bool) -> bool | None:
        """Admit `seq` if it fits: True when admitted, False when the step's token budget is short, None when
        the batch or the block pool is (which preempting others could mend)."""
        hits = self.kv.match_prefix(seq)
        placed = self.kv.place_preloaded(seq)
        pending = seq.num_tokens_to_compute
        num_tokens = pending if token_budget is None else min(pending, token_budget)
        if whole and num_tokens < pending:
            self.kv.free(seq)
            return False
        if len(self.running) >= self.max_num_seqs or not placed or not self.kv.grow(seq, num_tokens):
            self.kv.free(seq)
            return None
        self.kv.prefix_stats.record(seq.num_tokens, hits)
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = hits
            seq.num_reused_prompt_tokens = seq.num_computed_tokens
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.policy.start(self.running, seq)
        out.scheduled.append((seq, num_tokens))
        return True

    def _could_make_room(self, seq: Sequence, token_budget: int | None) -> bool:
        """Whether preempting every running sequence the policy ranks below `seq` would free a place in the batch
        and the blocks its admission needs (its whole prompt where it brings preloaded KV, else the budget's
        chunk after its cached prefix), so that none is preempted in vain."""
        victims = [s for s in self.running if self.policy.ranks_below(s, seq)]
        if not victims or len(self.running) - len(victims) >= self.max_num_seqs:
            return False
        hits = self.kv.cached_prefix_tokens(seq)
        end = seq.num_tokens if token_budget is None or seq.preloaded else min(seq.num_tokens, hits + token_budget)
        needed = self.kv.blocks_needed(end) - hits // self.kv.block_size
        return needed <= self.kv.pool.num_free + self.kv.blocks_freed_by(victims)

    def _next_to_admit(self, out: SchedulerOutput) -> Sequence | None:
        """The first waiting sequence in the policy's order, passing over those that share a prompt prefix with
        running sequences which have yet to compute it (requests that arrive together with one prompt, or `n`
        samples of it; `KVCacheManager.waits_for` says when waiting pays): each is admitted once the others
        computed the prefix, and reads it from the prefix cache, so a shared prefix is computed once. None when
        every waiting sequence waits so. Nobody waits in a step that runs nothing, so the engine never idles."""
        ahead = set()
        if self.shares_prefixes_in_flight and out.scheduled:
            ahead = self.kv.prompt_blocks_ahead(self.running)
        return next((seq for seq in self.waiting if not self.kv.waits_for(seq, ahead)), None)

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        """One token for every running sequence that is decoding."""
        for seq in [s for s in self.running if s.num_pending_tokens == 1]:
            if seq.status is SequenceStatus.RUNNING and self._grow_or_preempt(seq, 1, out):
                out.scheduled.append((seq, 1))

    def _add_drafts(self, out: SchedulerOutput, budget: int | None) -> None:
        """Speculative decoding: the step's decodes of output tokens take their drafts (`propose_drafts`), once
        everything else of the step has its blocks, where the pool has room (so drafts never preempt anything) and
        within what is left of a token budget."""
        if self.propose_drafts is None:
            return
        for index, (seq, num_tokens) in enumerate(out.scheduled):
            if budget is not None and budget <= 0:
                return
            if num_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
                continue  # a prefill, or a prompt's last token
            drafts = self.propose_drafts(seq)[:budget]
            if drafts and self.kv.grow(seq, 1 + len(drafts)):
                seq.draft_token_ids = drafts
                out.scheduled[index] = (seq, 1 + len(drafts))
                budget = None if budget is None else budget - len(drafts)

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Room for `num_tokens` more tokens of a running `seq`, preempting the last running sequences (the
        newest, or the worst by priority) if short.

        False when `seq` itself had to be preempted. Sequences are visited in the running queue's order, so the
        first always progresses and no step is left empty while anything runs.
        """
        while not self.kv.grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt_in_step(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt_in_step(self, victim: Sequence, out: SchedulerOutput) -> None:
        """Preempt `victim` while the step is being planned: whatever of it the step had scheduled is dropped."""
        self.preempt(victim)
        out.preempted.append(victim)
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not victim]

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []  # it will be prefilled, not verified
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.policy.requeue(self.waiting, seq)
