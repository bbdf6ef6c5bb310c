"""How the packed tokens of one step map onto sequences and cache slots.

The runner builds one `AttentionBatch` per step; every layer's attention reads it. Sequences that
add exactly one token (decodes) come first in the packed order and are attended together in one
padded call; every other sequence (a prefill chunk) is attended on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ScheduledTokens:
    """One sequence's share of a step, as the scheduler decided it."""

    seq_id: int
    start: int  # position of the first new token = tokens already in the cache
    num_tokens: int
    block_table: list[int]


@dataclass
class SequenceSlice:
    seq_id: int
    rows: slice  # rows of the packed batch holding this sequence's new tokens
    context_len: int  # tokens in the cache once this step's are written
    block_table: torch.Tensor  # [blocks] on the compute device


@dataclass
class DecodeGroup:
    rows: slice
    block_tables: torch.Tensor  # [n, max_blocks], padded with the row's first block (masked out)
    context_lens: torch.Tensor  # [n]


@dataclass
class AttentionBatch:
    positions: torch.Tensor  # [T] absolute position of each packed token
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each packed token
    sequences: list[SequenceSlice]  # in packed order
    decode: DecodeGroup | None
    prefills: list[SequenceSlice]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def build_attention_batch(
    scheduled: list[ScheduledTokens], block_size: int, device: torch.device
) -> AttentionBatch:
    """`scheduled` lists the single-token entries (decodes) first."""
    positions, slots, sequences = [], [], []
    row = 0
    for s in scheduled:
        pos = range(s.start, s.start + s.num_tokens)
        positions.extend(pos)
        slots.extend(s.block_table[p // block_size] * block_size + p % block_size for p in pos)
        sequences.append(
            SequenceSlice(
                seq_id=s.seq_id,
                rows=slice(row, row + s.num_tokens),
                context_len=s.start + s.num_tokens,
                block_table=torch.tensor(s.block_table, dtype=torch.long, device=device),
            )
        )
        row += s.num_tokens
    num_decodes = next((i for i, s in enumerate(scheduled) if s.num_tokens != 1), len(scheduled))
    assert all(s.num_tokens != 1 for s in scheduled[num_decodes:]), "decodes must come first"
    decodes = sequences[:num_decodes]
    return AttentionBatch(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        sequences=sequences,
        decode=_decode_group(decodes, device) if decodes else None,
        prefills=sequences[len(decodes):],
        block_size=block_size,
    )


def _decode_group(decodes: list[SequenceSlice], device: torch.device) -> DecodeGroup:
    widest = max(sl.block_table.shape[0] for sl in decodes)
    tables = torch.empty(len(decodes), widest, dtype=torch.long, device=device)
    for i, sl in enumerate(decodes):
        tables[i, : sl.block_table.shape[0]] = sl.block_table
        tables[i, sl.block_table.shape[0] :] = sl.block_table[0]
    return DecodeGroup(
        rows=slice(0, len(decodes)),
        block_tables=tables,
        context_lens=torch.tensor([sl.context_len for sl in decodes], dtype=torch.long, device=device),
    )
