"""How the packed tokens of one step map onto sequences, cache slots and the keys they may read.

The runner builds one `AttentionBatch` per step, on the compute device; every layer reads it.
Sequences that add exactly one token (decodes) come first in the packed order and form one
`AttentionGroup`; every other sequence (a prefill chunk) is a group of its own. A group's
`keys` are every cached key of its sequences once the step's tokens are written; a policy may
read them all or pick a subset, and masks follow from the keys' positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.kv.reference_attention import NO_KEY, causal_mask
from kvstrata.kv.slots import slots_of_positions


class CachedKeys:
    """Keys of n sequences as rows of cache slots with their positions ([n, Tk]; position -1: none).

    Whole-block keys (`block_tables` [n, B]: column j is block j // block_size of the table, offset
    j % block_size) let storage copy or read whole blocks; their slots, and their positions (from the
    sequences' `context_lens`), are worked out only if something asks for them (a subset, a mask, or storage
    that reads slot by slot; a compiled reader takes the tables and lengths as they are).
    """

    def __init__(self, positions: torch.Tensor | None, slots: torch.Tensor | None = None,
                 block_tables: torch.Tensor | None = None, block_size: int = 0,
                 context_lens: torch.Tensor | None = None):
        self._positions = positions
        self.block_tables = block_tables
        self.block_size = block_size
        self._context_lens = context_lens
        self._slots = slots
        self._mask: tuple[AttentionGroup, torch.Tensor] | None = None

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:  # whole-block keys: a row's columns from its context length on are padding
            n, width = self.block_tables.shape[0], self.width
            positions = torch.arange(width, device=self.block_tables.device).expand(n, width)
            self._positions = positions.masked_fill(positions >= self._context_lens[:, None], NO_KEY)
        return self._positions

    @property
    def context_lens(self) -> torch.Tensor | None:
        """Whole-block keys' context lengths [n] (None for keys given slot by slot)."""
        return self._context_lens

    @property
    def width(self) -> int:
        return self.block_tables.shape[1] * self.block_size if self._positions is None else self._positions.shape[1]

    @property
    def slots(self) -> torch.Tensor:
        if self._slots is None:
            columns = torch.arange(self.width, device=self.block_tables.device)
            self._slots = slots_of_positions(self.block_tables, columns, self.block_size)
        return self._slots

    def mask_for(self, group: AttentionGroup) -> torch.Tensor:
        """The group's causal mask over these keys, made once and reused by every layer that reads them."""
        if self._mask is None or self._mask[0] is not group:
            self._mask = (group, causal_mask(group.q_positions, self.positions))
        return self._mask[1]

    def take(self, columns: torch.Tensor, valid: torch.Tensor | None = None) -> CachedKeys:
        """A subset: the keys at `columns` [n, K] of each row; where `valid` is False, a padding row."""
        positions = self.positions.gather(1, columns)
        if valid is not None:
            positions = positions.masked_fill(~valid, NO_KEY)
        return CachedKeys(positions, self.slots.gather(1, columns))


@dataclass
class AttentionGroup:
    """Sequences attended in one call: all the step's decodes, or one prefill chunk."""

    rows: slice  # rows of the packed batch holding the group's new tokens, sequence after sequence
    q_positions: torch.Tensor  # [n, Tq] positions of the new tokens
    context_lens: torch.Tensor  # [n] tokens in each sequence's cache once this step's are written
    keys: CachedKeys  # every cached key, [n, Tk] with Tk >= the longest context
    # a prompt chunk's first position: its queries are chunk_start, chunk_start + 1, ... and its keys whole blocks
    # (key j at position j); None for the decodes' group
    chunk_start: int | None = None

    @property
    def num_sequences(self) -> int:
        return self.q_positions.shape[0]

    @property
    def is_decode(self) -> bool:
        """One new token per sequence: decodes (and a prompt whose last chunk is a single token)."""
        return self.q_positions.shape[1] == 1


@dataclass
class AttentionBatch:
    positions: torch.Tensor  # [T] absolute position of each packed token
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each packed token
    groups: list[AttentionGroup]  # in packed order: the decodes' group first
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def keys_per_sequence(keys: CachedKeys) -> tuple[CachedKeys, torch.Tensor] | None:
    """Whole-block decode keys in which a sequence verifying drafts has a row per token, consecutive rows with one
    block table: the keys once per run of rows with one table (to the run's longest row: each row reads a prefix of
    them) and each row's run. None where no two neighbouring rows share a table."""
    tables = keys.block_tables
    firsts = torch.ones(len(tables), dtype=torch.bool, device=tables.device)
    firsts[1:] = (tables[1:] != tables[:-1]).any(1)
    if bool(firsts.all()):
        return None
    run_of_row = firsts.cumsum(0) - 1
    lens = keys.context_lens.new_zeros(int(run_of_row[-1]) + 1).scatter_reduce(0, run_of_row, keys.context_lens, "amax")
    return whole_block_keys(tables[firsts], lens, keys.block_size), run_of_row


def whole_block_keys(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> CachedKeys:
    """Every cached key of sequences whose blocks are the rows of `block_tables` [n, B] (padded rows may
    repeat a block: positions at or beyond a row's context length are padding)."""
    return CachedKeys(None, block_tables=block_tables, block_size=block_size, context_lens=context_lens)
