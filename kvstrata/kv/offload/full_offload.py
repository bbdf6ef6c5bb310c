"""`--kv-offload full`: FlexGen-style offload, the baseline InfiniGen beats (papers/infinigen.md §1).

Every layer's KV lives in the host pool (the engine's storage, allocated on the host in any `--kv-format`);
the step's new K/V are written there, and before each layer's attention the K/V it reads are gathered in the
pool and copied to the compute device. On a CPU-only machine host and device are both main memory, but the
working copy is still a separate allocation and every byte of it is copied and counted. There a float pool's
whole blocks are copied straight into the working copy, and that copy is the transfer: FlexGen keeps each
sequence's KV in one piece on the host and a paged pool (vLLM's swap) sends its blocks one by one, so neither
gathers on the host first. Other pools are decoded (gathered) on the host, then copied.
"""

from __future__ import annotations

import torch

from kvstrata.kv.attention_batch import AttentionBatch, AttentionGroup, CachedKeys, keys_per_sequence
from kvstrata.kv.attention_policy import AttentionPolicy, attend_keys, outputs_of_groups
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.offload.transfers import OffloadStats, WorkingBuffers, to_host
from kvstrata.kv.reference_attention import attend
from kvstrata.kv.storage import KVStorage


class FullOffload(AttentionPolicy):
    def __init__(self, storage: KVStorage, device: torch.device, row_bytes: float, stats: OffloadStats,
                 compiled_kernels: bool = True):
        """row_bytes: what one token of one KV head of one layer (K and V) takes in the host pool's format."""
        super().__init__(storage)
        self.device = device
        self.row_bytes = row_bytes
        self.stats = stats
        self.buffers = WorkingBuffers(device)  # where fetched K/V land on the device
        # on the CPU, decodes attend over what was copied with a compiled kernel where the kernels build (off:
        # --no-paged-kernel), as they do without offload
        self.kernel = paged_decode.kernel() if compiled_kernels and device.type == "cpu" else None
        # the step's index tensors on the host, copied there once per step: every layer reads them, and on a GPU
        # each copy waits for the device
        self._step_on_host: tuple[torch.Tensor, torch.Tensor] | None = None
        self._keys_on_host: dict[int, tuple[CachedKeys, CachedKeys]] = {}
        # the step's decodes verifying drafts: their keys once per sequence, and each row's sequence
        self._per_sequence: tuple[AttentionGroup, tuple[CachedKeys, torch.Tensor] | None] | None = None

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        self._step_on_host = None
        self._keys_on_host.clear()
        self._per_sequence = None

    def attention(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  batch: AttentionBatch) -> torch.Tensor:
        self.storage.store(layer, *self.step_on_host(batch), *to_host(self.storage.device, k_new, v_new))
        self.stats.written_bytes[layer] += k_new.nbytes + v_new.nbytes
        self.after_store(layer, batch, k_new)
        return outputs_of_groups(q, batch, lambda group: self.attend_group(layer, q[group.rows], k_new[group.rows],
                                                                          v_new[group.rows], group))

    def step_on_host(self, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's slots and positions in the host pool's memory, copied there at the step's first layer."""
        if self._step_on_host is None:
            self._step_on_host = tuple(to_host(self.storage.device, batch.slot_mapping, batch.positions))
        return self._step_on_host

    def after_store(self, layer: int, batch: AttentionBatch, k_new: torch.Tensor) -> None:
        """The step's new keys of `layer` are in the pool (InfiniGen keeps their partial keys on the device)."""

    def attend_group(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     group: AttentionGroup) -> torch.Tensor:
        keys = self.select_keys(layer, group)
        # sequences verifying drafts have a row per token: their contexts are copied once, each row reads its own
        per_sequence = self.keys_per_sequence(group) if keys is group.keys else None
        fetched_keys, sequence_of_row = per_sequence or (keys, None)
        k, v = self.fetch(layer, fetched_keys, q.dtype)
        if group.is_decode:
            rows = int((self.keys_on_host(fetched_keys).positions >= 0).sum()) * self.storage.kv_shape[0]
            self.stats.decode_rows(layer, fetched=rows, cached=rows)
        readable = self.readable(layer, keys)
        if (group.is_decode and readable is None and keys.block_tables is not None and self.kernel is not None
                and q.dtype == torch.float32):
            return self._attend_whole_contexts(q, k, v, group, sequence_of_row)
        if sequence_of_row is not None:
            k, v = k[sequence_of_row], v[sequence_of_row]
        if readable is None:
            return attend_keys(q, k, v, group, keys)
        queries = q.view(group.num_sequences, -1, *q.shape[1:])
        return attend(queries, k, v, keys.mask_for(group) & readable[:, None]).flatten(0, 1)

    def keys_per_sequence(self, group: AttentionGroup) -> tuple[CachedKeys, torch.Tensor] | None:
        """`keys_per_sequence` of the step's decodes, worked out once a step (None: no sequence verifies drafts)."""
        if not group.is_decode or group.keys.block_tables is None:
            return None
        if self._per_sequence is None or self._per_sequence[0] is not group:
            self._per_sequence = (group, keys_per_sequence(group.keys))
        return self._per_sequence[1]

    def _attend_whole_contexts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup,
                               sequence_of_row: torch.Tensor | None = None) -> torch.Tensor:
        """Decodes over their whole copied contexts (k, v [m, Tk, kv_heads, D], whole blocks, a context each: row r
        reads the first context_lens[r] tokens of context sequence_of_row[r], by default context r), compiled
        (kv/kernels/fetched_attention.cpp)."""
        n, width, kv_heads, dim = k.shape
        # views where the storage gathers heads outermost (the float pools); a copy where it gathers token-major rows
        rows = [x.permute(2, 0, 1, 3).reshape(kv_heads, n * width, dim) for x in (k, v)]
        sequence_of_row = torch.arange(n) if sequence_of_row is None else sequence_of_row
        starts = (sequence_of_row * width).expand(kv_heads, -1)
        lens = group.context_lens.expand(kv_heads, -1)
        with torch.profiler.record_function("kvstrata::fetched_attention"):  # named in profiles
            return self.kernel.fetched_attention(q, *rows, starts, lens, dim**-0.5)

    def readable(self, layer: int, keys: CachedKeys) -> torch.Tensor | None:
        """Which of `keys` [n, Tk] this layer may still read (None: all; InfiniGen's capped pool gives some up)."""
        return None

    def keys_on_host(self, keys: CachedKeys) -> CachedKeys:
        """`keys` with its index tensors in the host pool's memory, copied there once per step."""
        entry = self._keys_on_host.get(id(keys))
        if entry is None or entry[0] is not keys:  # the entry holds `keys`, so its id is not reused in the step
            entry = self._keys_on_host[id(keys)] = (keys, on_device(keys, self.storage.device))
        return entry[1]

    def fetch(self, layer: int, keys: CachedKeys, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather `keys` in the host pool and copy them to the device ([n, Tk, kv_heads, D] each)."""
        on_host = self.keys_on_host(keys)
        rows = keys.positions.numel() * self.storage.kv_shape[0]
        if self.device.type == "cpu" and on_host.block_tables is not None:
            # host and device are one memory: whole blocks copied as stored into the working buffers are the
            # transfer, as a paged pool sends its blocks to a GPU (block by block, no gather on the host beside it)
            with self.stats.copying():
                copied = self.storage.copy_stored_blocks(layer, on_host.block_tables, self.buffers.empty)
            if copied is not None:
                self.stats.fetched(layer, sum(x.nbytes for x in copied), round(rows * self.row_bytes))
                return tuple(x.to(dtype) for x in copied)
        k, v = self.storage.gather_keys(layer, on_host, dtype)
        self.stats.fetched(layer, k.nbytes + v.nbytes, round(rows * self.row_bytes))
        return self.stats.copy_to(self.buffers, ("k", "v"), k, v)


def on_device(keys: CachedKeys, device: torch.device) -> CachedKeys:
    """`keys` with its index tensors on `device` (the host pool's), the same object where they already are."""
    if keys.block_tables is not None:
        if keys.block_tables.device == device:  # positions and slots are worked out only if asked for
            return keys
        return CachedKeys(keys.positions.to(device), block_tables=keys.block_tables.to(device),
                          block_size=keys.block_size)
    if keys.positions.device == device:
        return keys
    return CachedKeys(keys.positions.to(device), keys.slots.to(device))
