"""Which cached blocks a query reads under a sliding window, in whole blocks: the cache manager's prefix matching
and release behind the window, and a kv-aware router's picture of what a replica can reuse, count them alike.

A query at position p reads the keys at p - window + 1 .. p; without a window (None) it reads every earlier key.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


def window_in_force(window: int | None, max_model_len: int) -> int | None:
    """A model's sliding window where some context passes it (max_model_len beyond it); None where every query
    reads every earlier key."""
    return window if window is not None and max_model_len > window else None


def blocks_behind(position: int, block_size: int, window: int | None) -> int:
    """The leading blocks wholly before the window of a query at `position`: no query from there on reads them."""
    return 0 if window is None else max(0, (position - window + 1) // block_size)


def blocks_behind_prefix(num_blocks: int, block_size: int, window: int | None) -> int:
    """Of the first `num_blocks` blocks, those behind the window of the query right after them; a window shorter
    than a block keeps the last one."""
    return min(blocks_behind(num_blocks * block_size, block_size, window), max(num_blocks - 1, 0))


def longest_readable_prefix(held: Iterable[bool], block_size: int, window: int | None) -> int:
    """The longest prefix, in blocks, whose next query finds every block it reads held, given whether each of a
    prompt's blocks is held, in order. Without a window that is the run of held blocks from the first; with one, a
    block the window has passed may be missing. Without a window `held` is read only up to its first gap."""
    if window is None:  # every later query reads a missing block
        return sum(1 for _ in itertools.takewhile(bool, held))
    longest = run = 0  # run: the held blocks in a row, up to the one looked at
    for index, is_held in enumerate(held):
        if not is_held:
            run = 0
            continue
        run += 1
        if run >= index + 1 - blocks_behind_prefix(index + 1, block_size, window):
            longest = index + 1
    return longest
