"""The paged KV cache on the compute device: one preallocated tensor per K and V."""

from __future__ import annotations

import torch

from kvstrata.kv.attention_batch import AttentionBatch
from kvstrata.kv.reference_attention import causal_attention


class PagedKVCache:
    """Full-precision paged storage: [layers, blocks, block_size, kv_heads, head_dim] for K and V."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # empty, not zeros: pages cost memory (and zeroing costs time) only once a block is used;
        # `zero_blocks` clears each block the first time the pool hands it out.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def zero_blocks(self, blocks: list[int]) -> None:
        """Clear blocks never used before. Decode attention reads a block's unwritten tail (masked
        out), and a NaN left there by the allocator would still leak: 0 weight times NaN is NaN."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        self.k.index_fill_(1, index, 0)
        self.v.index_fill_(1, index, 0)

    def on_layer_input(self, layer: int, x: torch.Tensor, batch: AttentionBatch) -> None:
        pass

    def attention(self, layer, q, k_new, v_new, batch: AttentionBatch) -> torch.Tensor:
        k_layer, v_layer = self.k[layer], self.v[layer]
        k_layer.view(-1, *k_new.shape[1:]).index_copy_(0, batch.slot_mapping, k_new.to(k_layer.dtype))
        v_layer.view(-1, *v_new.shape[1:]).index_copy_(0, batch.slot_mapping, v_new.to(v_layer.dtype))
        out = torch.empty_like(q)
        if batch.decode is not None:
            group = batch.decode
            keys, values = _gather(k_layer, group.block_tables), _gather(v_layer, group.block_tables)
            out[group.rows] = causal_attention(
                q[group.rows, None], keys, values, (group.context_lens - 1)[:, None], group.context_lens
            )[:, 0]
        for chunk in batch.prefills:
            keys = _gather(k_layer, chunk.block_table[None])[:, : chunk.context_len]
            values = _gather(v_layer, chunk.block_table[None])[:, : chunk.context_len]
            out[chunk.rows] = causal_attention(q[None, chunk.rows], keys, values, batch.positions[None, chunk.rows])[0]
        return out

    def write(self, block_table: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V [layers, n, kv_heads, head_dim] of tokens start .. start + n of a sequence."""
        positions = torch.arange(start, start + k.shape[1], device=self.k.device)
        table = torch.tensor(block_table, dtype=torch.long, device=self.k.device)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        for cache, values in ((self.k, k), (self.v, v)):
            cache.view(cache.shape[0], -1, *cache.shape[3:]).index_copy_(1, slots, values.to(cache.dtype))

    def read(self, layer: int, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_tokens, kv_heads, head_dim] of one sequence, for tests and tools."""
        blocks = torch.tensor([block_table], dtype=torch.long, device=self.k.device)
        return _gather(self.k[layer], blocks)[0, :num_tokens], _gather(self.v[layer], blocks)[0, :num_tokens]


def _gather(layer_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[n, blocks * block_size, kv_heads, head_dim] from a layer's [blocks, block_size, ...] pool.

    index_select copies whole blocks as contiguous rows: several times faster on CPU than
    advanced indexing of the 5-D tensor.
    """
    n, width = block_tables.shape
    picked = layer_cache.index_select(0, block_tables.reshape(-1))
    return picked.view(n, width * layer_cache.shape[1], *layer_cache.shape[2:])
