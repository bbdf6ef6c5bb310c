"""Peak resident memory of this process over a block of code, sampled in a background thread."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import psutil


@contextmanager
def peak_rss(interval: float = 0.05):
    """Yields a one-item list that holds the peak RSS in bytes once the block ends."""
    process = psutil.Process()
    peak = [process.memory_info().rss]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()
        peak[0] = max(peak[0], process.memory_info().rss)
