"""Full-precision paged KV storage: one preallocated tensor per K and V, in the storage dtype."""

from __future__ import annotations

import torch

from kvstrata.kv.attention_batch import CachedKeys
from kvstrata.kv.storage import KVStorage


class PagedKVCache(KVStorage):
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
        # `reset_blocks` clears each block when the pool hands it out.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_layers = num_layers
        self.kv_shape = (num_kv_heads, head_dim)
        self.device = device

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def reset_blocks(self, blocks: list[int]) -> None:
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        self.k.index_fill_(1, index, 0)
        self.v.index_fill_(1, index, 0)

    def store(self, layer, slots, positions, k, v) -> None:
        for cache, values in ((self.k[layer], k), (self.v[layer], v)):
            cache.view(-1, *values.shape[1:]).index_copy_(0, slots, values.to(cache.dtype))

    def gather(self, layer, slots, positions, dtype):
        n, width = slots.shape
        flat = slots.reshape(-1)
        return tuple(cache[layer].view(-1, *self.kv_shape).index_select(0, flat).view(n, width, *self.kv_shape)
                     .to(dtype) for cache in (self.k, self.v))

    def gather_keys(self, layer, keys: CachedKeys, dtype):
        if keys.block_tables is None:
            return super().gather_keys(layer, keys, dtype)
        return _gather_blocks(self.k[layer], keys.block_tables).to(dtype), \
            _gather_blocks(self.v[layer], keys.block_tables).to(dtype)


def _gather_blocks(layer_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[n, blocks * block_size, kv_heads, head_dim] from a layer's [blocks, block_size, ...] pool.

    index_select copies whole blocks as contiguous rows: several times faster on CPU than
    advanced indexing of the 5-D tensor.
    """
    n, width = block_tables.shape
    picked = layer_cache.index_select(0, block_tables.reshape(-1))
    return picked.view(n, width * layer_cache.shape[1], *layer_cache.shape[2:])
