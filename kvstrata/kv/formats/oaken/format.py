"""Oaken as a paged-cache format: each token's K and V are grouped by the model's offline thresholds,
quantized per token (4-bit dense, 5-bit outliers) and packed into a fixed-size dense record plus
variable-length sparse entries (papers/oaken.md §3, §6).

Keys: the cache holds keys after RoPE. With `keys="post-rope"` (the default: on the default model it
measured slightly better) the stored key is quantized as it is; with "pre-rope" (the authors' code
profiles k_proj outputs) a key is rotated back before it is quantized and rotated again after it is
decoded, at its position. With `center_keys` (the default; ours, not the paper's) the model's mean key
(offline, thresholds.py) is subtracted first, rotated to the key's position after RoPE, and added back
after decoding: most of a key's range is that mean, which a per-token scale would otherwise spend its
16 levels on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv.formats.base import EncodedTokens, KVFormat
from kvstrata.kv.formats.oaken.codec import (
    decode_tokens,
    dense_bytes,
    encode_tokens,
    encode_tokens_compiled,
    encoder_tables,
    reader_tables,
    sparse_entry_bytes,
)
from kvstrata.kv.formats.oaken.groups import OakenConfig
from kvstrata.kv.formats.oaken.thresholds import OakenThresholds
from kvstrata.kv.kernels.arguments import int64_rows
from kvstrata.model.rotary import RotaryEmbedding, apply_rope, undo_rope


class OakenFormat(KVFormat):
    name = "oaken"
    has_sparse = True
    encodes_decoded_exactly = False

    def __init__(self, num_kv_heads: int, head_dim: int, thresholds: OakenThresholds, config: OakenConfig,
                 keys: str = "post-rope", rotary: RotaryEmbedding | None = None, center_keys: bool = True,
                 max_positions: int | None = None):
        super().__init__(num_kv_heads * head_dim)
        self.head_shape = (num_kv_heads, head_dim)
        self.config = config
        self.keys = keys
        self.rotary = rotary  # None: no RoPE (OPT), keys are the same before and after
        # the longest sequence the engine runs: the GPU kernels read RoPE's tables this long for the mean key's
        # rotation, since they cannot grow them on demand without waiting for the device (None: no GPU path)
        self.max_positions = max_positions
        self._cos_sin_table: tuple[torch.Tensor, torch.Tensor] | None = None  # per position, grown on demand
        self._cos_sin_flat: tuple[torch.Tensor, torch.Tensor] | None = None  # the same, [P, head_dim]
        self._layer_mean_keys: tuple[torch.Tensor, ...] | None = None  # key_mean's rows, on the device last asked
        self._reader_tables: dict[tuple[int, str], tuple[list[torch.Tensor], list[float]]] = {}  # per (layer, kind)
        self._encoder_tables: dict[tuple[int, str], tuple] = {}  # per (layer, kind)
        # per layer: the storage's tensors, and what the compiled store and reader take (_kept_for_layer)
        self._kept_store_sides: dict[int, tuple] = {}
        self._kept_reader_sides: dict[int, tuple] = {}
        self.key_mean = thresholds.k_mean if center_keys else None
        if center_keys and thresholds.k_mean.shape[1] != self.width:
            raise KvstrataError(f"the thresholds' mean key has {thresholds.k_mean.shape[1]} channels, the model's "
                                f"keys {self.width}")
        self.bounds = {
            (layer, kind): thresholds.bounds(layer, kind, keys, center_keys)
            for layer in range(thresholds.num_layers) for kind in "kv"
        }

    @property
    def record_bytes(self) -> int:
        return dense_bytes(self.width, self.config)

    @property
    def expected_sparse_bytes(self) -> float:
        outlier_fraction = 1 - self.config.ratios[self.config.dense_group]
        return outlier_fraction * self.width * sparse_entry_bytes(self.config)

    @property
    def max_sparse_bytes(self) -> int:
        return self.width * sparse_entry_bytes(self.config)

    def encode(self, x, layer, kind, positions) -> EncodedTokens:
        if kind == "k":
            x = self._quantized_key(x, layer, positions)
        compiled = encode_tokens_compiled(x, self.bounds[layer, kind], self.config)
        if compiled is not None:
            return EncodedTokens(*compiled)
        encoded = encode_tokens(x, self.bounds[layer, kind], self.config)
        return EncodedTokens(encoded.dense, encoded.sparse, encoded.sparse_bytes.long())

    def decode(self, dense, sparse, layer, kind, positions) -> torch.Tensor:
        x = decode_tokens(dense, sparse, self.bounds[layer, kind], self.config, self.width)
        return self._cached_key(x, layer, positions) if kind == "k" else x

    def store_in_place(self, kernel, layer, slots, positions, k, v, records, sparse):
        """The compiled store (kv/kernels/oaken_store.cpp): keys put in their quantized form as `_quantized_key`
        puts them, then `encode` and the storage's writes, with the same bytes."""
        if self.config.scales != "token" or k.device.type != "cpu" or not len(k):
            return False
        center, rotate_back = self._key_transform()
        positions, slots = int64_rows(positions), int64_rows(slots)
        cos, sin = self._rope_rows(lambda: int(positions.max()) + 1, center == 2 or rotate_back, k.device)
        mean = self._layer_mean_key(layer, k.device)
        while True:
            short = kernel.oaken_store(k, v, positions, slots, *self._store_sides(layer, records, sparse), mean, cos,
                                       sin)
            if short[0] < 0:  # a value out of float16's range: the torch path raises the clear error
                return False
            if not any(short):
                return True
            for kind, pages in zip("kv", short):
                if pages:
                    sparse[kind].grow(pages)

    def _store_sides(self, layer, records, sparse) -> tuple[list, list, list[int]]:
        """The compiled store's K and V sides ([records, the sparse pages' writer tensors, the encoder's tables]) and
        layout for this layer."""
        def build():
            tables = {kind: self._encoder_table(layer, kind, records["k"].device) for kind in "kv"}
            center, rotate_back = self._key_transform()
            layout = [*tables["k"][4], sparse["k"].block_size, sparse["k"].page_bytes, center, int(rotate_back)]
            return ([records["k"], *sparse["k"].writer_tensors(layer), *tables["k"][:4]],
                    [records["v"], *sparse["v"].writer_tensors(layer), *tables["v"][:4]], layout)

        return self._kept_for_layer(self._kept_store_sides, layer, records, sparse, build)

    def _kept_for_layer(self, kept: dict, layer: int, records, sparse, build):
        """`build()`'s arguments of this layer for a compiled kernel, built once and again only where the storage's
        tensors are new (a sparse pool grew, another storage): every layer of every step passes them."""
        tensors = (records["k"], records["v"], sparse["k"].writer_tensors(layer), sparse["v"].writer_tensors(layer))
        entry = kept.get(layer)
        if entry is None or any(now is not then for now, then in zip(tensors, entry[0])):
            entry = kept[layer] = (tensors, build())
        return entry[1]

    def attend_in_place(self, kernel, layer, q, records, sparse, block_tables, context_lens, block_size,
                        min_shared_tokens=0, window=0):
        """The compiled reader decodes each row as `decode` does, keys put back as `_cached_key` puts them."""
        return kernel.paged_decode_attention_oaken(
            q, *self._reader_arguments(layer, records, sparse, context_lens), block_tables, context_lens, block_size,
            self.head_shape[0], q.shape[-1] ** -0.5, min_shared_tokens, window)

    def read_in_place(self, kernel, layer, records, sparse, block_tables, context_lens, block_size):
        return kernel.paged_read_oaken(*self._reader_arguments(layer, records, sparse, context_lens), block_tables,
                                       context_lens, block_size, *self.head_shape)

    def _reader_arguments(self, layer, records, sparse, context_lens) -> list:
        """What the compiled reader takes about this layer: each side's records, pages and tables, the shifts, the
        layout, the mean key and RoPE's tables."""
        device = records["k"].device
        add_mean, rotate_key = self._key_transform()

        def build():
            tables, shifts = {}, {}
            for kind in "kv":
                tables[kind], shifts[kind] = self._reader_table(layer, kind, device)
            layout = [self.config.num_groups, self.config.dense_group, sparse_entry_bytes(self.config),
                      int(self.config.outliers == "fp16"), sparse["k"].page_bytes, add_mean, int(rotate_key)]
            return [[records["k"], *sparse["k"].layer_tensors(layer), *tables["k"]],
                    [records["v"], *sparse["v"].layer_tensors(layer), *tables["v"]], shifts["k"], shifts["v"], layout,
                    self._layer_mean_key(layer, device)]

        cos, sin = self._rope_rows(lambda: int(context_lens.max()), add_mean == 2 or rotate_key, device)
        return [*self._kept_for_layer(self._kept_reader_sides, layer, records, sparse, build), cos, sin]

    def store_on_gpu(self, layer, slots, positions, k, v, records, sparse):
        """The GPU encoder (kv/gpu/oaken_encode.py) and sparse-page writer, for scales per token and keys quantized
        after RoPE (centered keys also need `max_positions`)."""
        from kvstrata.kv.gpu import oaken_encode  # imports Triton: only where the GPU kernels run

        center, rotate_back = self._key_transform()
        if self.config.scales != "token" or rotate_back or (center == 2 and self.max_positions is None):
            return False
        cos, sin = self._cos_sin_rows(self.max_positions if center == 2 else 0, k.device)
        for kind, x in (("k", k), ("v", v)):
            add_mean = center if kind == "k" else 0  # the kernels read the mean key only where it is added back
            entries, entry_bytes = oaken_encode.oaken_encode(
                x, positions, slots, records[kind], self._encoder_table(layer, kind, k.device),
                self._gpu_layout(add_mean), self._layer_mean_key(layer, k.device), cos, sin)
            sparse[kind].append_on_gpu(layer, slots, entries, entry_bytes)
        return True

    def gather_on_gpu(self, layer, kind, records, sparse, slots, positions, dtype):
        """The GPU reader decodes each row as `decode` does; keys quantized before RoPE it leaves to the torch path, as
        it does centered keys where the format does not know the longest sequence (`max_positions`)."""
        from kvstrata.kv.gpu import oaken_rows  # imports Triton: only where the GPU kernels run

        add_mean, rotate_key = self._key_transform() if kind == "k" else (0, False)
        if rotate_key or (add_mean == 2 and self.max_positions is None):
            return None
        tables, shift = self._reader_table(layer, kind, records.device)
        cos, sin = self._cos_sin_rows(self.max_positions if add_mean == 2 else 0, records.device)
        layout = {**self._gpu_layout(add_mean), "block_size": sparse.block_size, "page_bytes": sparse.page_bytes}
        return oaken_rows.oaken_decode(records, sparse.layer_tensors(layer), tables, shift, layout,
                                       self._layer_mean_key(layer, records.device), cos, sin, slots, positions, dtype)

    def _encoder_table(self, layer: int, kind: str, device: torch.device):
        """The compiled and GPU encoders' tables of (layer, kind), built on first use."""
        if (layer, kind) not in self._encoder_tables:
            self._encoder_tables[layer, kind] = encoder_tables(self.bounds[layer, kind], self.config, device)
        return self._encoder_tables[layer, kind]

    def _reader_table(self, layer: int, kind: str, device: torch.device):
        """The compiled and GPU readers' tables and shift of (layer, kind), built on first use."""
        if (layer, kind) not in self._reader_tables:
            self._reader_tables[layer, kind] = reader_tables(self.bounds[layer, kind], self.config, device)
        return self._reader_tables[layer, kind]

    def _gpu_layout(self, add_mean: int) -> dict:
        """What the GPU kernels take about the records: width, groups, dense group, entry bytes, float16 outliers,
        whether the mean key is added back (0, 1, or 2: rotated to the position) and the head size."""
        return {"width": self.width, "groups": self.config.num_groups, "dense_group": self.config.dense_group,
                "entry_bytes": sparse_entry_bytes(self.config), "float16_outliers": self.config.outliers == "fp16",
                "add_mean": add_mean, "head_dim": self.head_shape[1]}

    def _key_transform(self) -> tuple[int, bool]:
        """How a cached key differs from the vector Oaken quantizes, as the compiled kernels take it: the mean key
        (0 none, 1 as it is, 2 rotated to the key's position) and whether the key is quantized before RoPE."""
        rotary = self.rotary is not None
        center = 0 if self.key_mean is None else 2 if rotary and self.keys == "post-rope" else 1
        return center, rotary and self.keys == "pre-rope"

    def _layer_mean_key(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer `layer`'s mean key [width] (empty without key centering)."""
        if self.key_mean is None:
            return torch.empty(0, device=device)
        if self._layer_mean_keys is None or self._layer_mean_keys[0].device != device:
            self._layer_mean_keys = self._key_mean_on(device).unbind(0)  # views, made once: every store reads one
        return self._layer_mean_keys[layer]

    def _cos_sin_rows(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin tables [P, head_dim] covering positions below `size` (empty where size is 0)."""
        if not size:
            empty = torch.empty(0, device=device)
            return empty, empty
        self._cos_sin_up_to(size, device)
        return self._cos_sin_flat

    def _rope_rows(self, size: Callable[[], int], needed: bool, device: torch.device):
        """`_cos_sin_rows` for the compiled kernels, which check that the tables cover every position they read:
        `max_positions` long where the format knows the longest sequence, which spares finding the largest position
        (`size()`) on every call; empty where the kernel reads no RoPE table (not `needed`)."""
        return self._cos_sin_rows((self.max_positions or size()) if needed else 0, device)

    def _quantized_key(self, x: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """The vector Oaken quantizes for a key as the cache holds it."""
        if self.keys == "pre-rope":
            x = self._rotate(x, positions, undo_rope)
        return x if self.key_mean is None else x - self._mean_key(layer, positions)

    def _cached_key(self, x: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Inverse of `_quantized_key`."""
        if self.key_mean is not None:
            x = x + self._mean_key(layer, positions)
        return self._rotate(x, positions, apply_rope) if self.keys == "pre-rope" else x

    def _mean_key(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """[1, W] before RoPE, [N, W] rotated to each position after it."""
        mean = self._key_mean_on(positions.device)[layer][None]
        if self.keys == "pre-rope" or self.rotary is None:
            return mean
        # the one mean broadcast against each position's angles: no [N, W] copy of it is rotated
        return apply_rope(mean.view(1, *self.head_shape), *self._cos_sin(positions)).reshape(len(positions), -1)

    def _key_mean_on(self, device: torch.device) -> torch.Tensor:
        """The mean keys [layers, width], moved to `device` once."""
        if self.key_mean.device != device:
            self.key_mean = self.key_mean.to(device)
        return self.key_mean

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, rotation) -> torch.Tensor:
        if self.rotary is None:
            return x
        return rotation(x.view(x.shape[0], *self.head_shape), *self._cos_sin(positions)).reshape(x.shape[0], -1)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin [N, 1, head_dim] at `positions`, gathered from a table: every read of the cache
        needs them for every cached token, and the table spares the trigonometry (same values, computed once)."""
        size = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self._cos_sin_up_to(size, positions.device)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _cos_sin_up_to(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The table of cos and sin [P, 1, head_dim] for positions 0 .. P-1, P >= size."""
        table = self._cos_sin_table
        if table is None or len(table[0]) < size or table[0].device != device:
            grown = max(size, 2 * len(table[0]) if table is not None else 1024)
            table = self._cos_sin_table = self.rotary.cos_sin(torch.arange(grown, device=device), torch.float32)
            self._cos_sin_flat = tuple(t.view(grown, -1) for t in table)
        return table
