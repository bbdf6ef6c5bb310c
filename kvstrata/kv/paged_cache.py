"""Full-precision paged KV storage: one preallocated tensor per K and V, in the storage dtype."""

from __future__ import annotations

import torch

from kvstrata.kv.attention_batch import CachedKeys
from kvstrata.kv.storage import KVStorage


class PagedKVCache(KVStorage):
    """[layers, kv_heads, blocks, block_size, head_dim] for K and V; fp32, bf16 or fp16 storage.

    Heads outermost: gathered blocks come out as [kv_heads, n, tokens, head_dim], which batched matrix
    products read without another copy (the reference attention's decode path)."""

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
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
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
        self.k.index_fill_(2, index, 0)
        self.v.index_fill_(2, index, 0)

    def _slot_view(self, cache: torch.Tensor, layer: int) -> torch.Tensor:
        """A layer's pool as [kv_heads, slots, head_dim]."""
        return cache[layer].view(self.kv_shape[0], -1, self.kv_shape[1])

    def store(self, layer, slots, positions, k, v) -> None:
        for cache, values in ((self.k, k), (self.v, v)):
            self._slot_view(cache, layer).index_copy_(1, slots, values.transpose(0, 1).to(cache.dtype))

    def gather(self, layer, slots, positions, dtype):
        n, width = slots.shape
        return tuple(_heads_inside(self._slot_view(cache, layer).index_select(1, slots.reshape(-1))
                                   .view(-1, n, width, self.kv_shape[1]).to(dtype)) for cache in (self.k, self.v))

    def gather_keys(self, layer, keys: CachedKeys, dtype):
        """Whole blocks are copied block by block (several times faster on CPU than slot by slot)."""
        if keys.block_tables is None:
            return super().gather_keys(layer, keys, dtype)
        n, width = keys.block_tables.shape
        flat = keys.block_tables.reshape(-1)
        return tuple(_heads_inside(cache[layer].index_select(1, flat).view(-1, n, width * self.block_size,
                                                                            self.kv_shape[1]).to(dtype))
                     for cache in (self.k, self.v))


def _heads_inside(gathered: torch.Tensor) -> torch.Tensor:
    """[kv_heads, n, tokens, head_dim] as the [n, tokens, kv_heads, head_dim] view the seam hands over."""
    return gathered.permute(1, 2, 0, 3)
