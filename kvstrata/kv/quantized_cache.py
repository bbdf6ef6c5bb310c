"""Paged KV storage that keeps every token in a quantized format (kv/formats): each new token is
encoded when it is written and the tokens attention reads are decoded when they are gathered.

Per layer and per K/V: fixed-size records [blocks * block_size, record_bytes] (uint8; K's and V's may differ in
size, kv/formats/split.py), and for formats with outliers kept apart, sparse pages (kv/sparse_pages.py).
"""

from __future__ import annotations

import torch

from kvstrata.kv import gpu
from kvstrata.kv.formats.base import KVFormat
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.kernels.arguments import float32_rows, whole_block_rows
from kvstrata.kv.slots import block_slots
from kvstrata.kv.sparse_pages import SparsePages
from kvstrata.kv.storage import KVStorage

SPARSE_PAGE_BYTES = 256
SPARSE_HEADROOM = 1.25  # sparse pages reserved beyond the expected outlier bytes (the pool grows if short)


class QuantizedPagedKVCache(KVStorage):
    def __init__(self, kv_format: KVFormat, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, in_place_decode: bool = True, cascade_min_tokens: int = 0):
        self.format = kv_format
        self.block_size = block_size
        self.num_layers = num_layers
        self.kv_shape = (num_kv_heads, head_dim)
        self.device = device
        slots = num_blocks * block_size
        self.records = {kind: torch.zeros(num_layers, slots, kv_format.record_bytes_of(kind), dtype=torch.uint8,
                                          device=device) for kind in ("k", "v")}
        # each layer's records as the stores and readers take them, views made once rather than on every call
        self._layer_records = [{kind: records[layer] for kind, records in self.records.items()}
                               for layer in range(num_layers)]
        # on the CPU, decodes read the records where they lie, dequantizing one row at a time in the compiled
        # kernel (if it builds and the format has a reader); elsewhere every gathered token is decoded first
        self.decode_kernel = paged_decode.kernel() if in_place_decode and device.type == "cpu" else None
        self.cascade_min_tokens = cascade_min_tokens  # ... reading a prefix the decodes share once for all (0: never)
        # on the CPU, formats with a compiled writer encode and write a layer's new K/V in one call
        self.store_kernel = paged_decode.kernel() if device.type == "cpu" else None
        # on a GPU, formats with Triton kernels (kv/gpu) encode, and decode what is gathered, a launch or two each
        self.gpu_kernels = in_place_decode and gpu.runs_on(device)
        self.sparse: dict[str, SparsePages] = {}
        self.keeps_discarded_tokens = kv_format.has_sparse  # a token written again appends its outliers
        if kv_format.has_sparse:
            pages = int(slots * kv_format.expected_sparse_bytes * SPARSE_HEADROOM / SPARSE_PAGE_BYTES) + 1
            self.sparse = {kind: SparsePages(num_layers, num_blocks, block_size, SPARSE_PAGE_BYTES, pages,
                                             kv_format.max_sparse_bytes, device) for kind in ("k", "v")}

    def restores_exactly(self, dtype: torch.dtype) -> bool:
        return self.format.encodes_decoded_exactly and super().restores_exactly(dtype)

    @staticmethod
    def bytes_per_token(kv_format: KVFormat, num_layers: int) -> float:
        """What one token costs the budget: K and V records, expected sparse bytes and their table entry."""
        per_layer = kv_format.record_bytes_of("k") + kv_format.record_bytes_of("v")
        if kv_format.has_sparse:
            per_layer += 2 * (kv_format.expected_sparse_bytes * SPARSE_HEADROOM + SparsePages.TABLE_BYTES)
        return num_layers * per_layer

    def grown_bytes(self) -> int:
        return sum(pages.grown_bytes() for pages in self.sparse.values())

    def reset_blocks(self, blocks: list[int]) -> None:
        slots = block_slots(torch.tensor(blocks, dtype=torch.long, device=self.device), self.block_size)
        for records in self.records.values():
            records.index_fill_(1, slots, 0)
        for pages in self.sparse.values():
            pages.release(blocks)

    def discard_tokens(self, slots: torch.Tensor) -> None:
        # a token's records are overwritten in place; its outliers were appended to its block's sparse pages
        for pages in self.sparse.values():
            pages.discard(slots)

    def store(self, layer, slots, positions, k, v) -> None:
        k, v = float32_rows(k), float32_rows(v)
        layer_records = self._layer_records[layer]
        if self.gpu_kernels:
            with torch.profiler.record_function(f"kvstrata::gpu_store_{self.format.name}"):  # host time, in profiles
                if self.format.store_on_gpu(layer, slots, positions, k, v, layer_records, self.sparse):
                    return
        if self.store_kernel is not None and self.format.store_in_place(
                self.store_kernel, layer, slots, positions, k, v, layer_records, self.sparse):
            return
        # both sides encoded before either is written: a value the format refuses leaves the cache as it was
        encoded_sides = {kind: self.format.encode(x, layer, kind, positions) for kind, x in (("k", k), ("v", v))}
        for kind, encoded in encoded_sides.items():
            layer_records[kind].index_copy_(0, slots, encoded.dense)
            if kind in self.sparse:
                self.sparse[kind].write(layer, slots, encoded.sparse, encoded.sparse_bytes)

    def attend_in_place(self, layer, q, keys, context_lens, window=0):
        if self.decode_kernel is None or q.dtype != torch.float32:
            return None
        with torch.profiler.record_function(f"kvstrata::paged_decode_attention_{self.format.name}"):  # in profiles
            return self.format.attend_in_place(
                self.decode_kernel, layer, q, self._layer_records[layer],
                self.sparse, keys.block_tables, context_lens, self.block_size, self.cascade_min_tokens, window)

    def gather_keys(self, layer, keys, dtype):
        """Whole-block keys (a prefill chunk's) are decoded where they lie by the format's compiled reader, where the
        decodes' is (`attend_in_place`) and the format has one."""
        if keys.block_tables is not None and self.decode_kernel is not None:
            read = self.format.read_in_place(self.decode_kernel, layer, self._layer_records[layer], self.sparse,
                                             keys.block_tables, keys.context_lens, self.block_size)
            if read is not None:
                return whole_block_rows(read, self.kv_shape, dtype)
        return super().gather_keys(layer, keys, dtype)

    def gather(self, layer, slots, positions, dtype):
        """Padding rows (position -1) come back as zeros. Every row is decoded, padding at slot 0 and
        position 0, rather than picking out the real rows: that would wait for the device to count them."""
        if self.gpu_kernels:
            with torch.profiler.record_function(f"kvstrata::gpu_gather_{self.format.name}"):  # host time, in profiles
                gathered = self._gather_on_gpu(layer, slots, positions, dtype)
            if gathered is not None:
                return gathered
        valid = (positions >= 0).reshape(-1, 1)
        wanted = torch.where(valid[:, 0], slots.reshape(-1), 0)
        at = positions.reshape(-1).clamp(min=0)
        out = []
        for kind in ("k", "v"):
            dense = self.records[kind][layer].index_select(0, wanted)
            sparse = self.sparse[kind].read(layer, wanted) if kind in self.sparse else None
            values = torch.where(valid, self.format.decode(dense, sparse, layer, kind, at), 0).to(dtype)
            out.append(values.view(*slots.shape, *self.kv_shape))
        return out[0], out[1]

    def _gather_on_gpu(self, layer, slots, positions, dtype):
        """`gather` by the format's GPU kernels, one launch per K/V; None where it has none."""
        flat_slots, flat_positions = slots.reshape(-1), positions.reshape(-1)
        out = []
        for kind in ("k", "v"):
            values = self.format.gather_on_gpu(layer, kind, self.records[kind][layer], self.sparse.get(kind),
                                               flat_slots, flat_positions, dtype)
            if values is None:
                return None
            out.append(values.view(*slots.shape, *self.kv_shape))
        return out[0], out[1]
