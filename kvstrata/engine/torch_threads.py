"""How many threads this thread's torch ops use.

torch keeps the count per thread, and a process-wide one besides: a thread that has not yet asked for its count
or run a parallel op takes the process-wide count (the last that any thread set) when it first does. So a thread
that sets its own count first takes the process-wide one, and a thread that must keep a count re-asserts it where
another thread may have set one before its first op (the server's engine thread: LLMEngine.step). A thread
that sets none (IMPRESS's reorderer) runs on whatever count was set last: after the KV store's decoder
threads start, one.
"""

from __future__ import annotations

import os

import torch

from kvstrata.errors import KvstrataError


def default_threads() -> int:
    """The threads an engine runs on unless --threads says: OMP_NUM_THREADS where set (torch's own default reads
    it too; of a list of nesting levels, "4,2", the first), else every core this process may run on (its CPU
    affinity, which a container or `taskset` narrows)."""
    setting = os.environ.get("OMP_NUM_THREADS", "")
    if setting.strip():
        first = setting.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise KvstrataError(f"OMP_NUM_THREADS={setting!r} does not start with a positive whole number of threads")
        return int(first)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def use_torch_threads(count: int) -> None:
    """Run this thread's torch ops on `count` threads."""
    torch.get_num_threads()  # this thread takes the process-wide count now, not at its first op after ours
    torch.set_num_threads(count)


def keep_torch_threads(count: int) -> None:
    """`use_torch_threads(count)` unless this thread already runs on `count` (cheap enough for every step)."""
    if torch.get_num_threads() != count:
        use_torch_threads(count)
