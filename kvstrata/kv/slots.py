"""Slot arithmetic, in one place: token `p` of a sequence lives in slot table[p // block_size] *
block_size + p % block_size of the paged pool."""

from __future__ import annotations

import torch


def slots_of_positions(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of `positions` in the sequences whose block tables are the rows of `block_tables` [n, B].

    `positions` is [n, W] (per row) or [W] (the same for every row); the result is [n, W]. Positions
    beyond a table's blocks are not allowed.
    """
    positions = positions.expand(block_tables.shape[0], -1) if positions.dim() == 1 else positions
    return block_tables.gather(1, positions // block_size) * block_size + positions % block_size


def token_slots(block_tables, rows, positions, block_size: int):
    """Slots [T] of tokens at `positions` [T] of the sequences whose tables are rows `rows` [T] of `block_tables`
    (torch tensors or numpy arrays alike)."""
    return block_tables[rows, positions // block_size] * block_size + positions % block_size


def block_slots(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every slot of `blocks` [n], block after block ([n * block_size])."""
    return (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).flatten()
