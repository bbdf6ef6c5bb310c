"""Persistent block tables: one row per sequence, kept between steps and updated only where it changed.

A sequence keeps its row while it runs; each step writes only the blocks it gained, and the leading
entries it gave back behind a sliding window. A row's columns past the sequence's blocks repeat its first
block, so a padded read of them stays inside memory the sequence owns (finite values; attention masks
them out by position).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, rows: int):
        self.table = np.zeros((rows, max_blocks_per_seq), dtype=np.int64)
        # id(sequence) -> row, least recently used first (an id reused by a new object is caught by `_sync`)
        self.row_of: OrderedDict[int, int] = OrderedDict()
        self.source: list[list[int] | None] = [None] * rows  # the block list each row copies
        self.filled = [0] * rows  # how many of that list's blocks the row holds
        self.released = [0] * rows  # how many of its leading entries were given back when last copied

    def rows_for(self, sequences: list) -> np.ndarray:
        """Rows holding the current block tables of `sequences` (objects with a block_table list and
        num_released_blocks)."""
        in_step = {id(seq) for seq in sequences}
        rows = np.empty(len(sequences), dtype=np.int64)
        for i, seq in enumerate(sequences):
            row = self.row_of.get(id(seq))
            if row is None:
                row = self._take_row(in_step)
                self.row_of[id(seq)] = row
            self.row_of.move_to_end(id(seq))
            self._sync(row, seq.block_table, seq.num_released_blocks)
            rows[i] = row
        return rows

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The whole table, shared with the array on the CPU."""
        table = torch.from_numpy(self.table)
        return table if device.type == "cpu" else table.to(device, non_blocking=True)

    def _sync(self, row: int, blocks: list[int], released: int) -> None:
        # A freed sequence gets a new list (kv/cache_manager.py), so a list other than the one copied means
        # the row starts over.
        if self.source[row] is not blocks or self.filled[row] > len(blocks):
            self.source[row], self.filled[row], self.released[row] = blocks, 0, 0
        have = self.filled[row]
        if have < len(blocks):
            self.table[row, have : len(blocks)] = blocks[have:]
            self.filled[row] = len(blocks)
        if blocks and (have == 0 or released > self.released[row]):  # given back: repeat the first block held
            self.table[row, :released] = blocks[released]
            self.table[row, len(blocks) :] = blocks[released]
            self.released[row] = released

    def _take_row(self, in_step: set[int]) -> int:
        if len(self.row_of) < len(self.table):
            return len(self.row_of)
        for key in self.row_of:  # least recently used first
            if key not in in_step:
                row = self.row_of.pop(key)
                self.source[row] = None
                return row
        grown = np.zeros_like(self.table)
        self.table = np.concatenate([self.table, grown])
        self.source.extend([None] * len(grown))
        self.filled.extend([0] * len(grown))
        self.released.extend([0] * len(grown))
        return len(self.row_of)
