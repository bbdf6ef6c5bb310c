"""The order in which a scheduler admits waiting sequences and preempts running ones (vLLM's
`--scheduling-policy`).

Both queues are kept in the policy's order, so that the scheduler always admits `waiting`'s first sequence that
need not wait and, short of KV blocks, preempts `running`'s last one.

- `fcfs`: first come, first served. The waiting are admitted in arrival order, a preempted sequence goes back
  to the front of the queue, and the sequence admitted last is preempted first.
- `priority`: each request's `priority` (lower runs earlier; ties go by arrival) orders both queues, and a
  waiting sequence that finds no room preempts running ones of a worse priority until it fits (as vLLM's
  priority scheduling does), so a request sent urgent does not wait for a batch of others to finish.
"""

from __future__ import annotations

import bisect
from collections import deque

from kvstrata.engine.sequence import Sequence


class FirstComeFirstServed:
    preempts_for_admission = False

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        waiting.append(seq)

    def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """A preempted sequence goes first: it had started before any that waits."""
        waiting.appendleft(seq)

    def start(self, running: list[Sequence], seq: Sequence) -> None:
        running.append(seq)


def _rank(seq: Sequence) -> tuple[int, float, int]:
    return seq.params.priority, seq.arrival_time, seq.seq_id


class ByPriority:
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


def scheduling_policy(name: str) -> FirstComeFirstServed | ByPriority:
    return ByPriority() if name == "priority" else FirstComeFirstServed()
