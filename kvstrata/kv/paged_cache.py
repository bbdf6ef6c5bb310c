"""The full-precision paged KV cache: one preallocated tensor per K and V, in the storage dtype."""

from __future__ import annotations

import torch

from kvstrata.kv.paged_attention import PagedAttention


class PagedKVCache(PagedAttention):
    """[layers, blocks, block_size, kv_heads, head_dim] for K and V; fp32, bf16 or fp16 storage."""

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
        # `zero_blocks` clears each block when the pool hands it out.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_layers = num_layers
        self.device = device

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def zero_blocks(self, blocks: list[int]) -> None:
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        self.k.index_fill_(1, index, 0)
        self.v.index_fill_(1, index, 0)

    def store_tokens(self, layer, slots, positions, k, v) -> None:
        for cache, values in ((self.k[layer], k), (self.v[layer], v)):
            cache.view(-1, *values.shape[1:]).index_copy_(0, slots, values.to(cache.dtype))

    def load_tokens(self, layer, block_tables, num_tokens, dtype):
        return (_gather(self.k[layer], block_tables)[:, :num_tokens].to(dtype),
                _gather(self.v[layer], block_tables)[:, :num_tokens].to(dtype))


def _gather(layer_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[n, blocks * block_size, kv_heads, head_dim] from a layer's [blocks, block_size, ...] pool.

    index_select copies whole blocks as contiguous rows: several times faster on CPU than
    advanced indexing of the 5-D tensor.
    """
    n, width = block_tables.shape
    picked = layer_cache.index_select(0, block_tables.reshape(-1))
    return picked.view(n, width * layer_cache.shape[1], *layer_cache.shape[2:])
