"""Attention over a paged cache, whatever the storage: store the step's new K/V, load each
sequence's blocks, call the one reference attention. Storage classes supply `store_tokens` and
`load_tokens`."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvstrata.kv.attention_batch import AttentionBatch
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.reference_attention import causal_attention


class PagedAttention(ABC):
    block_size: int
    num_layers: int

    @abstractmethod
    def store_tokens(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Write K and V [n, kv_heads, head_dim] of tokens at cache slots [n] (sequence positions [n])."""

    @abstractmethod
    def load_tokens(self, layer: int, block_tables: torch.Tensor, num_tokens: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [n, num_tokens, kv_heads, head_dim] of the sequences whose blocks are the rows of
        `block_tables` [n, blocks]; token j sits at position j."""

    @abstractmethod
    def zero_blocks(self, blocks: list[int]) -> None:
        """Forget what newly allocated blocks held. Decode attention reads a block's unwritten tail
        (masked out), and a NaN left there would still leak: 0 weight times NaN is NaN."""

    def on_layer_input(self, layer: int, x: torch.Tensor, batch: AttentionBatch) -> None:
        pass

    def attach_block_pool(self, pool: BlockPool) -> None:
        """The engine's block pool, for storage that must know which blocks no sequence holds (KIVI)."""

    def attention(self, layer, q, k_new, v_new, batch: AttentionBatch) -> torch.Tensor:
        self.store_tokens(layer, batch.slot_mapping, batch.positions, k_new, v_new)
        out = torch.empty_like(q)
        if batch.decode is not None:
            group = batch.decode
            width = group.block_tables.shape[1] * self.block_size
            keys, values = self.load_tokens(layer, group.block_tables, width, q.dtype)
            out[group.rows] = causal_attention(
                q[group.rows, None], keys, values, (group.context_lens - 1)[:, None], group.context_lens
            )[:, 0]
        for chunk in batch.prefills:
            blocks = chunk.block_table[None, : -(-chunk.context_len // self.block_size)]
            keys, values = self.load_tokens(layer, blocks, chunk.context_len, q.dtype)
            out[chunk.rows] = causal_attention(q[None, chunk.rows], keys, values, batch.positions[None, chunk.rows])[0]
        return out

    def write(self, block_table: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V [layers, n, kv_heads, head_dim] of tokens start .. start + n of a sequence."""
        device = self.device
        positions = torch.arange(start, start + k.shape[1], device=device)
        table = torch.tensor(block_table, dtype=torch.long, device=device)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        for layer in range(self.num_layers):
            self.store_tokens(layer, slots, positions, k[layer], v[layer])

    def read(self, layer: int, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_tokens, kv_heads, head_dim] of one sequence (decoded), for tests and tools."""
        blocks = torch.tensor([block_table[: -(-num_tokens // self.block_size)]], dtype=torch.long, device=self.device)
        k, v = self.load_tokens(layer, blocks, num_tokens, torch.float32)
        return k[0], v[0]
