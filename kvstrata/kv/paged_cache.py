"""Full-precision paged KV storage: one preallocated tensor per K and V, in the storage dtype."""

from __future__ import annotations

import torch

from kvstrata.kv.attention_batch import CachedKeys
from kvstrata.kv.fused_decode import FusedDecode
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.preloaded import PreloadedKV
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
        in_place_decode: bool = True,
        cascade_min_tokens: int = 0,
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
        # on the CPU, decodes read their blocks where they lie, with the compiled kernel (if it builds)
        self.decode_kernel = paged_decode.kernel() if in_place_decode and device.type == "cpu" else None
        self.cascade_min_tokens = cascade_min_tokens  # ... reading a prefix the decodes share once for all (0: never)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def reset_blocks(self, blocks: list[int]) -> None:
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        self.k.index_fill_(2, index, 0)
        self.v.index_fill_(2, index, 0)

    def store(self, layer, slots, positions, k, v) -> None:
        for cache, values in ((self.k, k), (self.v, v)):
            slot_rows = cache[layer].view(self.kv_shape[0], -1, self.kv_shape[1])  # [kv_heads, slots, head_dim]
            slot_rows.index_copy_(1, slots, values.transpose(0, 1).to(cache.dtype))

    def gather(self, layer, slots, positions, dtype):
        n, width = slots.shape
        return tuple(_seam_layout(gather_rows_per_head(cache[layer].view(self.kv_shape[0], -1, self.kv_shape[1]),
                                               slots.reshape(-1)), n, width, dtype) for cache in (self.k, self.v))

    def restores_exactly(self, dtype):
        """Also where the storage holds the compute dtype itself."""
        return dtype in (torch.float32, self.k.dtype)

    def write(self, block_table, kv, first, end):
        """KV with every layer at hand, on this device in this dtype, is stored in one index_copy each for K and V
        (another is converted layer by layer, so no whole extra copy is made)."""
        if not isinstance(kv, PreloadedKV) or kv.k.device != self.device or kv.k.dtype != self.k.dtype:
            return super().write(block_table, kv, first, end)
        _, _, slots = self.sequence_range(block_table, first, end)
        layers, kv_heads, head_dim = self.num_layers, *self.kv_shape
        for cache, values in ((self.k, kv.k), (self.v, kv.v)):
            rows = values[:, first - kv.start : end - kv.start].transpose(1, 2)  # [layers, kv_heads, n, head_dim]
            cache.view(layers, kv_heads, -1, head_dim).index_copy_(2, slots, rows)

    def read_layers(self, block_table, end, first=0):
        """Every layer's rows in one index_select each for K and V."""
        _, _, slots = self.sequence_range(block_table, first, end)
        layers, kv_heads, head_dim = self.num_layers, *self.kv_shape
        return tuple(cache.view(layers, kv_heads, -1, head_dim).index_select(2, slots).transpose(1, 2).float()
                     for cache in (self.k, self.v))

    def gather_per_head(self, layer, slots, positions, dtype):
        """Each head's own rows: only the selected tokens are read (compiled: K and V of every head in one call;
        else one index_select per head)."""
        kv_heads, n, width = slots.shape
        return tuple(rows.view(kv_heads, n, width, self.kv_shape[1]).to(dtype)
                     for rows in self._rows_per_head(layer, slots.reshape(kv_heads, -1)))

    def copy_stored_rows(self, layer, slots, empty):
        return tuple(self._rows_per_head(layer, slots, empty))

    def _rows_per_head(self, layer: int, slots: torch.Tensor, empty=None) -> list[torch.Tensor]:
        """K and V of each head's own rows `slots` [kv_heads, R], [kv_heads, R, head_dim] each in the storage dtype,
        in tensors from `empty` (KVStorage.copy_stored_rows) where given."""
        kv_heads, rows = slots.shape
        pools = [cache[layer].view(kv_heads, -1, self.kv_shape[1]) for cache in (self.k, self.v)]
        outs = [_empty_like_rows(empty, name, (kv_heads, rows, self.kv_shape[1]), pool)
                for name, pool in zip(("k", "v"), pools)]
        if self.decode_kernel is not None:
            with torch.profiler.record_function("kvstrata::gather_rows"):  # named in profiles
                self.decode_kernel.gather_rows(pools, slots, outs)
        else:
            for pool, out in zip(pools, outs):
                for head in range(kv_heads):
                    torch.index_select(pool[head], 0, slots[head], out=out[head])
        return outs

    def attend_in_place(self, layer, q, keys, context_lens, window=0):
        if self.decode_kernel is None or q.dtype != torch.float32:
            return None
        with torch.profiler.record_function("kvstrata::paged_decode_attention"):  # named in profiles
            return self.decode_kernel.paged_decode_attention(q, self.k[layer], self.v[layer], keys.block_tables,
                                                             context_lens, q.shape[-1] ** -0.5,
                                                             self.cascade_min_tokens, window)

    def fused_decode(self, batch, dtype):
        keys = batch.groups[0].keys
        if self.decode_kernel is None or dtype != torch.float32 or keys.block_tables is None:
            return None
        return FusedDecode(self.k, self.v, batch.slot_mapping, keys.block_tables, batch.groups[0].context_lens,
                           self.cascade_min_tokens)

    def gather_keys(self, layer, keys: CachedKeys, dtype):
        """Whole blocks are copied block by block (several times faster on CPU than slot by slot)."""
        if keys.block_tables is None:
            return super().gather_keys(layer, keys, dtype)
        n, width = keys.block_tables.shape
        return tuple(_seam_layout(rows, n, width * self.block_size, dtype)
                     for rows in self._whole_blocks(layer, keys.block_tables))

    def copy_stored_blocks(self, layer, block_tables, empty):
        n, width = block_tables.shape
        return tuple(_seam_layout(rows, n, width * self.block_size, rows.dtype)
                     for rows in self._whole_blocks(layer, block_tables, empty))

    def _whole_blocks(self, layer: int, block_tables: torch.Tensor, empty=None) -> list[torch.Tensor]:
        """K and V of the blocks of `block_tables`, [kv_heads, blocks, block_size, head_dim] each in the storage
        dtype, in tensors from `empty` (KVStorage.copy_stored_blocks) where given."""
        index = block_tables.reshape(-1)
        shape = (self.kv_shape[0], len(index), self.block_size, self.kv_shape[1])
        return [gather_rows_per_head(cache[layer], index, _empty_like_rows(empty, name, shape, cache))
                for name, cache in (("k", self.k), ("v", self.v))]


def gather_rows_per_head(per_head: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `index` of every head of [kv_heads, rows, ...], as [kv_heads, len(index), ...] (in `out` where given):
    one contiguous index_select per head into its part of the result (on CPU several times faster than one
    index_select along dim 1)."""
    if out is None:
        out = torch.empty(per_head.shape[0], len(index), *per_head.shape[2:], dtype=per_head.dtype,
                          device=per_head.device)
    for head in range(per_head.shape[0]):
        torch.index_select(per_head[head], 0, index, out=out[head])
    return out


def _empty_like_rows(empty, name: str, shape: tuple[int, ...], pool: torch.Tensor) -> torch.Tensor:
    """Where rows of `pool` are gathered: `empty(name, shape, dtype)`'s tensor (a caller's buffer) where given, else
    new memory beside the pool."""
    if empty is not None:
        return empty(name, shape, pool.dtype)
    return torch.empty(shape, dtype=pool.dtype, device=pool.device)


def _seam_layout(gathered: torch.Tensor, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Gathered rows [kv_heads, n * width (...), head_dim] as the [n, width, kv_heads, head_dim] view the seam
    hands over; heads stay outermost in memory, which batched products read without another copy."""
    return gathered.view(-1, n, width, gathered.shape[-1]).to(dtype).permute(1, 2, 0, 3)
