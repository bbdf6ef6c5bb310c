"""The order in which a scheduler admits waiting sequences and preempts running ones (vLLM's
`--scheduling-policy`).

Both queues are kept in the policy's order, so that the scheduler always admits `waiting`'s first sequence that
need not wait and, short of KV blocks, preempts `running`'s last one.

- `fcfs`: first come, first served. The waiting are admitted in arrival order, a preempted sequence goes back
  to the front of the queue, and the sequence admitted last is preempted first.
- `priority`: each request's `priority` (lower runs earlier; ties go by arrival) orders both queues, and a
  waiting sequence that finds no room preempts running ones of a worse priority until it fits (as vLLM's
  priority scheduling does), so a request sent urgent does not wait for a batch of others to finish.
- `lpm`: longest prefix match first (SGLang's `--schedule-policy lpm`). Before each step the waiting are
  ordered by how many of their prompt's tokens the device pool holds now, or the KV store has loaded for them
  (most first, ties by arrival; the blocks running requests have computed so far count), so requests over a
  cached prefix run while it is there instead of after other prompts pushed it out: where many requests share a
  few long prefixes (documents asked several questions, few-shot prompts) and the pool holds only some of them,
  each prefix is computed about once. A
  request whose prefix nobody shares may wait behind a stream of ones that hit, as under SGLang's, unless
  `--lpm-aging-tokens-per-s` N counts N more tokens for every second a request has waited: it then overtakes a
  request matching M tokens that arrived M / N seconds or more after it. With more than LPM_MAX_WAITING waiting,
  matching them all every step would cost more than it saves, and the queue goes by arrival, as SGLang's does.
  The running sequence preempted is the newest, as under `fcfs`; it goes back to the waiting, where the next
  step's order places it (usually early: its blocks stay cached until reused).
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from kvstrata.engine.sequence import Sequence
from kvstrata.kv.cache_manager import KVCacheManager

LPM_MAX_WAITING = 128  # SGLang's bound


class FirstComeFirstServed:
    preempts_for_admission = False

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.append(seq)

    def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """A preempted sequence goes first: it had started before any that waits."""
        waiting.appendleft(seq)

    def start(self, running: list[Sequence], seq: Sequence) -> None:
        running.append(seq)

    def order(self, waiting: deque[Sequence], kv: KVCacheManager) -> None:
        """Put `waiting` in the order of the coming step's admissions (for a policy whose order changes with what
        the pool holds); the queue keeps its order otherwise."""


class LongestPrefixMatch(FirstComeFirstServed):
    def __init__(self, aging_tokens_per_s: float = 0.0):
        self.aging_tokens_per_s = aging_tokens_per_s

    def order(self, waiting: deque[Sequence], kv: KVCacheManager) -> None:
        if len(waiting) < 2:
            return
        if len(waiting) > LPM_MAX_WAITING:
            ranked = sorted(waiting, key=_arrival)
        else:
            now = time.perf_counter()  # the clock of Sequence.arrival_time

            def score(seq: Sequence) -> float:
                return _ready_tokens(seq, kv) + self.aging_tokens_per_s * (now - seq.arrival_time)

            ranked = sorted(waiting, key=lambda seq: (-score(seq), *_arrival(seq)))
        waiting.clear()
        waiting.extend(ranked)


def _ready_tokens(seq: Sequence, kv: KVCacheManager) -> int:
    """The prompt tokens `seq` would not compute if admitted now: the prefix the pool holds, continued by KV given
    ready-made (loaded from the KV store, or a saved context's) from there."""
    ready = kv.cached_prefix_tokens(seq)
    for segment in seq.preloaded:  # in order
        if segment.start <= ready < segment.end:
            ready = segment.end
    return ready


def _arrival(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id


def _rank(seq: Sequence) -> tuple[int, float, int]:
    return seq.params.priority, *_arrival(seq)


class ByPriority(FirstComeFirstServed):
    preempts_for_admission = True

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        bisect.insort(waiting, seq, key=_rank)

    def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        self.enqueue(waiting, seq)  # its arrival puts it ahead of the later requests of its priority

    def start(self, running: list[Sequence], seq: Sequence) -> None:
        bisect.insort(running, seq, key=_rank)

    def ranks_below(self, seq: Sequence, other: Sequence) -> bool:
        """Whether `seq` may be preempted to make room for `other`: its priority is worse (a larger number)."""
        return seq.params.priority > other.params.priority


def scheduling_policy(name: str, lpm_aging_tokens_per_s: float = 0.0) -> FirstComeFirstServed:
    if name == "lpm":
        return LongestPrefixMatch(lpm_aging_tokens_per_s)
    return ByPriority() if name == "priority" else FirstComeFirstServed()
