"""KIVI (Liu et al., 2024) in the paged cache: keys quantized per channel, values per token, each at
2 or 4 bits, and the newest tokens of every sequence kept in full precision.

A key channel's minimum and step are taken over the tokens of one cache block (KIVI's token group:
16 tokens by default, 32 as in the KIVI paper with --block-size 32); values are quantized per token in
groups of 32 channels. A block stays in full precision (float16, as KIVI's residual) in a window slot
until it lies wholly outside the sequence's newest `residual` tokens; then the whole block is
quantized at once, the same step for every layer. A block that a step both fills and leaves (most of a
long prefill chunk) never takes a window slot: its K/V are quantized straight from the step's, as KIVI
quantizes a prompt, so the window holds only what sequences keep in it. A block takes its slot in the
first step that writes into it. Blocks that never leave the window (a finished sequence's tail) keep their
full-precision slot while the pool has groups to spare; when it runs short, the slots of window blocks no
sequence holds go back, and those blocks leave the prefix cache (`_reclaim_slots`).

The window takes no memory of its own: a block's float16 K rows take the bytes of the 4-bit key codes of four
blocks (2-bit: eight), so a slot is a group of the pool's own blocks, lent by the pool (kv/block_groups.py) and
viewed as float16 in the code tensors. The cache manager has the slots that the running sequences may need lent
before each step (`groups_for`, `reserve`), and spare ones go back to the pool where it runs short of blocks: the
KV budget holds quantized blocks and window alike, whatever the number of sequences.

Every query of a step reads a block as it stands after the step (one leaving the window in it reads quantized), so
where a prompt's chunks end changes which of its tokens its own queries read at full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv import gpu
from kvstrata.kv.attention_batch import AttentionBatch
from kvstrata.kv.block_groups import GroupedBlockPool
from kvstrata.kv.formats.asymmetric import dequantize_asymmetric, quantize_asymmetric
from kvstrata.kv.formats.nibbles import pack_codes, unpack_codes
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.kernels.arguments import float32_rows, whole_block_rows
from kvstrata.kv.slots import block_slots
from kvstrata.kv.storage import KVStorage

VALUE_GROUP = 32  # channels sharing a value's minimum and step
PARAM_BYTES = 4  # float16 minimum + float16 step
NO_ROWS = torch.empty(0, dtype=torch.long)  # the window store's "every row of the step"


def slots_per_sequence(residual: int, block_size: int) -> int:
    """Window slots a sequence holds between steps at most: its blocks not wholly before its newest `residual`
    tokens."""
    return -(-residual // block_size) + 1


def slots_a_step_adds(chunk_size: int, residual: int) -> int:
    """Window slots a step with at most `chunk_size` new tokens holds besides: a block the step completes and that
    leaves the window at the step's end (it held the sequence's last tokens before the step) keeps its slot until
    then, one for each sequence given at least residual + 1 new tokens (and a context being written, one)."""
    return -(-chunk_size // (residual + 1))


def blocks_per_slot(bits: int) -> int:
    """Blocks whose codes hold one block's float16 K (or V) rows: 16 / bits."""
    return 16 // bits


@dataclass
class StepWrites:
    """Where a step's new tokens go, worked out once per step (`begin_step`) for every layer's `store`."""

    window_rows: torch.Tensor | None  # rows of the step's K/V written into the window (None: every row)
    window_places: torch.Tensor  # their row in a layer's window [window_slots * block_size, width]
    direct_blocks: torch.Tensor  # blocks the step fills that leave the window at once: quantized from its K/V
    direct_rows: torch.Tensor  # the rows of their tokens, block after block, in slot order
    completed_leaving: torch.Tensor  # window blocks the step completes that leave at its end


class KiviPagedKVCache(KVStorage):
    def __init__(self, bits: int, residual: int, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, device: torch.device, chunk_size: int,
                 in_place_decode: bool = True):
        self.bits, self.residual = bits, residual
        self.block_size, self.num_layers, self.device = block_size, num_layers, device
        self.kv_shape = (num_kv_heads, head_dim)
        width = num_kv_heads * head_dim
        self.width = width
        self.value_group = value_group(width)
        slots = num_blocks * block_size
        code_bytes = width * bits // 8
        self.key_codes = torch.zeros(num_layers, slots, code_bytes, dtype=torch.uint8, device=device)
        self.key_params = torch.zeros(num_layers, num_blocks, width, 2, dtype=torch.float16, device=device)
        self.value_codes = torch.zeros(num_layers, slots, code_bytes, dtype=torch.uint8, device=device)
        self.value_params = torch.zeros(num_layers, slots, width // self.value_group, 2, dtype=torch.float16,
                                        device=device)
        self.window_slot = torch.full((num_blocks,), -1, dtype=torch.long, device=device)  # -1: quantized
        # slot g: the codes of blocks g * blocks_per_slot .. (g + 1) * blocks_per_slot - 1, while the pool lends them
        self.group_size = blocks_per_slot(bits)
        if num_blocks % self.group_size:
            raise ValueError(f"KIVI at {bits} bits needs whole groups of {self.group_size} blocks, not {num_blocks}")
        slots = num_blocks // self.group_size
        self.window_k, self.window_v = (codes.view(num_layers, slots, -1).view(torch.float16)
                                        .view(num_layers, slots, block_size, width)
                                        for codes in (self.key_codes, self.value_codes))
        self.slots_per_sequence = slots_per_sequence(residual, block_size)
        self.slots_a_step_adds = slots_a_step_adds(chunk_size, residual)
        self.free_slots: list[int] = []  # lent and holding no block
        self.block_pool: GroupedBlockPool | None = None  # lends the slots; which blocks no sequence holds
        self._writes: StepWrites | None = None  # this step's (begin_step)
        self._reader_views: list | None = None  # per layer: _reader_tensors
        # each block's window slot as this step's reads see it: blocks leaving in this step are quantized in a
        # layer before that layer reads them (store comes first), so they read as quantized
        self._read_window = self.window_slot
        self._layers_quantized = 0  # layers whose leaving blocks are quantized already in this step
        # on the CPU, decodes read blocks and window where they lie, with the compiled kernel (if it builds)
        self.decode_kernel = paged_decode.kernel() if in_place_decode and device.type == "cpu" else None
        # on the CPU, the compiled writer puts a layer's new K and V into the window in one call
        self.store_kernel = paged_decode.kernel() if device.type == "cpu" else None
        # on a GPU, the gathered tokens are decoded by a Triton kernel (kv/gpu), one launch per K/V
        self.gpu_kernels = in_place_decode and gpu.runs_on(device)

    @staticmethod
    def bytes_per_token(bits: int, width: int, block_size: int, num_layers: int) -> float:
        """Quantized K and V: codes, key params per block channel, value params per 32-channel group."""
        codes = width * bits / 8
        key_params = width * PARAM_BYTES / block_size
        value_params = width // value_group(width) * PARAM_BYTES
        return num_layers * (2 * codes + key_params + value_params)

    # --- block lifecycle ----------------------------------------------------------------------

    def reset_blocks(self, blocks: list[int]) -> None:
        """A block handed out holds nothing: a window slot it kept from its last use goes back (the step that
        first writes into the block gives it a cleared one, unless the block leaves the window in that step)."""
        blocks = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self._release_window(blocks[self.window_slot[blocks] >= 0])

    def _give_slots(self, blocks: torch.Tensor) -> None:
        slots = [self._take_slot() for _ in range(len(blocks))]
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.window_slot[blocks] = index
        self.window_k.index_fill_(1, index, 0)  # an unwritten offset is read (masked out) as 0, never stale NaN
        self.window_v.index_fill_(1, index, 0)

    def attach_block_pool(self, pool: GroupedBlockPool) -> None:
        self.block_pool = pool

    # --- window slots lent by the pool (kv/block_groups.py's GroupBorrower) -------------------

    def groups_for(self, num_blocks: int) -> int:
        return min(self.slots_per_sequence, num_blocks)

    def reserve(self, groups: int, keep_free: int) -> bool:
        groups += self.slots_a_step_adds
        pool = self.block_pool
        if len(pool.lent) > groups and pool.num_free < keep_free:
            self._reclaim_slots()  # idle blocks' slots may go back too
            self._give_back(groups, keep_free)
        while len(pool.lent) < groups:
            if pool.num_free - self.group_size < keep_free or not self._lend_slot():
                return False
        return True

    def give_back_spare(self, groups: int) -> None:
        self._give_back(groups + self.slots_a_step_adds, keep_free=self.block_pool.num_blocks)  # every spare one

    def _lend_slot(self) -> bool:
        """One more slot, a group the pool lends; False where none is free. Its blocks' own window slots (idle
        blocks, whose cached content the pool just evicted) go back."""
        group = self.block_pool.lend_group()
        if group is None:
            return False
        blocks = torch.arange(group * self.group_size, (group + 1) * self.group_size, device=self.device)
        self._release_window(blocks[self.window_slot[blocks] >= 0])
        self.free_slots.append(group)
        return True

    def _give_back(self, groups: int, keep_free: int) -> None:
        """Return slots that hold no block to the pool while more than `groups` are lent and fewer than `keep_free`
        blocks are free."""
        pool = self.block_pool
        while self.free_slots and len(pool.lent) > groups and pool.num_free < keep_free:
            pool.take_back_group(self.free_slots.pop())

    def _take_slot(self) -> int:
        """A free slot; else one more lent while the pool has a free group (idle blocks keep theirs, for a prompt
        that shares them); else the idle blocks' slots (the cache manager had enough lent for what runs)."""
        if not self.free_slots and not self._lend_slot():
            self._reclaim_slots()
        if not self.free_slots:
            raise KvstrataError("KIVI's window found no group of free blocks for a slot: the KV cache is full")
        return self.free_slots.pop()

    def _reclaim_slots(self) -> None:
        """Free the slots of window blocks that no sequence holds. A cached one leaves the prefix cache: quantized
        before its time, it would read otherwise to a later prompt sharing it than it did to its own sequence (a
        preempted one recomputed, too), so what a block holds never depends on when its slot went back."""
        pool = self.block_pool
        held = (self.window_slot >= 0).nonzero().flatten().tolist()
        idle = [b for b in held if pool.ref_counts[b] == 0]
        for block in idle:
            pool.forget(block)
        self._release_window(torch.tensor(idle, dtype=torch.long, device=self.device))

    def _old_blocks(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """Blocks of the sequences whose tables are the rows of `block_tables` [n, B] that lie wholly before their
        newest `residual` tokens (context_lens [n]), each once. A block may fill several columns of a row (padding,
        and the entries given back behind a sliding window repeat one the sequence holds): it is old only where
        none of its columns holding the context is newer."""
        old_blocks = (context_lens - self.residual).clamp(min=0) // self.block_size
        used_blocks = (context_lens + self.block_size - 1) // self.block_size
        columns = torch.arange(block_tables.shape[1], device=self.device)[None, :]
        old = torch.unique(block_tables[columns < old_blocks[:, None]])
        newer = block_tables[(columns >= old_blocks[:, None]) & (columns < used_blocks[:, None])]
        return old[~torch.isin(old, newer)]

    def _quantize_blocks(self, layer: int, blocks: torch.Tensor) -> None:
        """Quantize window blocks from their slots."""
        if len(blocks):
            slots = self.window_slot[blocks]
            self._quantize(layer, blocks, self.window_k[layer, slots], self.window_v[layer, slots])

    def _quantize(self, layer: int, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store blocks [n] whose float16 K and V are `keys`, `values` [n, block_size, width] quantized."""
        codes, params = quantize_asymmetric(keys.float(), 1, self.bits)
        token_slots = block_slots(blocks, self.block_size)
        self.key_codes[layer, token_slots] = pack_codes(codes.reshape(-1, self.width), self.bits)
        self.key_params[layer, blocks] = params
        values = values.float().reshape(-1, self.width // self.value_group, self.value_group)
        codes, params = quantize_asymmetric(values, 2, self.bits)
        self.value_codes[layer, token_slots] = pack_codes(codes.reshape(-1, self.width), self.bits)
        self.value_params[layer, token_slots] = params

    def _release_window(self, blocks: torch.Tensor) -> None:
        self.free_slots.extend(self.window_slot[blocks].tolist())
        self.window_slot[blocks] = -1

    # --- the KVStorage interface --------------------------------------------------------------

    def begin_step(self, batch: AttentionBatch) -> None:
        old = [self._old_blocks(g.keys.block_tables, g.context_lens) for g in batch.groups]
        self._plan_writes(torch.unique(torch.cat(old)), batch.slot_mapping)

    def begin_write(self, block_table: torch.Tensor, slots: torch.Tensor, context_len: int) -> None:
        self._plan_writes(self._old_blocks(block_table, torch.tensor([context_len], device=self.device)), slots)

    def _plan_writes(self, old: torch.Tensor, slots: torch.Tensor) -> None:
        """Plan a step writing `slots` [T] after which the blocks `old` lie wholly before their sequence's newest
        `residual` tokens. Window blocks among them that the step does not write into were complete before it:
        quantized at once in every layer, their slots free for the step's own blocks. Window blocks it completes
        are quantized by each layer's `store`, after their last tokens; blocks it writes first get a slot, or,
        if they leave at once, are quantized straight from the step's K/V."""
        token_blocks = slots // self.block_size
        written = torch.unique(token_blocks)
        leaving = old[self.window_slot[old] >= 0]
        completed = torch.isin(leaving, written)
        done = leaving[~completed]
        for layer in range(self.num_layers):
            self._quantize_blocks(layer, done)
        self._release_window(done)
        fresh = written[self.window_slot[written] < 0]
        leave_at_once = torch.isin(fresh, old)
        self._give_slots(fresh[~leave_at_once])
        direct_blocks = fresh[leave_at_once]
        window_rows = direct_rows = None
        if len(direct_blocks):
            direct = torch.isin(token_blocks, direct_blocks)
            window_rows = (~direct).nonzero().flatten()
            direct_rows = direct.nonzero().flatten()
            direct_rows = direct_rows[torch.argsort(slots[direct_rows])]
        to_window = slots if window_rows is None else slots[window_rows]
        places = self.window_slot[to_window // self.block_size] * self.block_size + to_window % self.block_size
        self._writes = StepWrites(window_rows, places, direct_blocks, direct_rows, leaving[completed])
        self._read_window = self.window_slot.index_fill(0, self._writes.completed_leaving, -1)

    def end_step(self) -> None:
        """Blocks the step completed and that left the window give up their slots. A step that failed part-way
        quantizes them first in the layers it did not reach, so that no slot is lost."""
        if self._writes is not None:
            leaving = self._writes.completed_leaving
            for layer in range(self._layers_quantized, self.num_layers):
                self._quantize_blocks(layer, leaving)
            self._release_window(leaving)
            self._writes = None
            self._read_window = self.window_slot
        self._layers_quantized = 0

    def store(self, layer, slots, positions, k, v) -> None:
        plan = self._writes
        if self.store_kernel is not None:  # both sides in one call (kv/kernels/kivi_window_store.cpp)
            k, v = float32_rows(k), float32_rows(v)
            rows = plan.window_rows if plan.window_rows is not None else NO_ROWS
            self.store_kernel.kivi_window_store(k, v, rows, plan.window_places, self.window_k, self.window_v, layer)
        else:
            k, v = k.reshape(len(slots), -1).half(), v.reshape(len(slots), -1).half()
            rows = plan.window_rows
            for window, x in ((self.window_k, k), (self.window_v, v)):
                window[layer].view(-1, self.width)[plan.window_places] = x if rows is None else x[rows]
        if len(plan.direct_blocks):  # quantized from float16 rows, as from the window
            shape = (len(plan.direct_blocks), self.block_size, self.width)
            direct_k, direct_v = (x[plan.direct_rows].half().view(shape) for x in (k, v))
            self._quantize(layer, plan.direct_blocks, direct_k, direct_v)
        self._quantize_blocks(layer, plan.completed_leaving)
        self._layers_quantized = layer + 1

    def attend_in_place(self, layer, q, keys, context_lens, window=0):
        if self.decode_kernel is None or q.dtype != torch.float32:
            return None
        with torch.profiler.record_function("kvstrata::paged_decode_attention_kivi"):  # named in profiles
            return self.decode_kernel.paged_decode_attention_kivi(
                q, *self._reader_tensors(layer), self._read_window, keys.block_tables, context_lens, self.bits,
                self.kv_shape[0], q.shape[-1] ** -0.5, window)

    def gather_keys(self, layer, keys, dtype):
        """Whole-block keys (a prefill chunk's) are decoded where they lie by the compiled reader (the decodes')."""
        if keys.block_tables is None or self.decode_kernel is None:
            return super().gather_keys(layer, keys, dtype)
        read = self.decode_kernel.paged_read_kivi(*self._reader_tensors(layer), self._read_window, keys.block_tables,
                                                  keys.context_lens, self.bits, *self.kv_shape)
        return whole_block_rows(read, self.kv_shape, dtype)

    def _reader_tensors(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The compiled reader's keys and values of a layer: [codes, params, window] each, views made once per layer
        (every layer of every step passes them)."""
        if self._reader_views is None:
            self._reader_views = [([self.key_codes[n], self.key_params[n], self.window_k[n]],
                                   [self.value_codes[n], self.value_params[n], self.window_v[n]])
                                  for n in range(self.num_layers)]
        return self._reader_views[layer]

    def gather(self, layer, slots, positions, dtype):
        shape = (*slots.shape, *self.kv_shape)
        slots = slots.reshape(-1)
        if self.gpu_kernels:
            from kvstrata.kv.gpu import kivi_rows  # imports Triton: only where the GPU kernels run

            with torch.profiler.record_function("kvstrata::gpu_gather_kivi"):  # host time, in profiles
                keys = kivi_rows.kivi_decode(self.key_codes[layer], self.key_params[layer], self.window_k[layer],
                                             self._read_window, slots, self.bits, None, dtype)
                values = kivi_rows.kivi_decode(self.value_codes[layer], self.value_params[layer],
                                               self.window_v[layer], self._read_window, slots, self.bits,
                                               self.value_group, dtype)
            return keys.view(shape), values.view(shape)
        blocks = slots // self.block_size
        key_params = self.key_params[layer, blocks].float()  # a key channel's params are its block's
        keys = key_params[..., 0] + unpack_codes(self.key_codes[layer, slots], self.bits).float() * key_params[..., 1]
        codes = unpack_codes(self.value_codes[layer, slots], self.bits).view(len(slots), -1, self.value_group)
        values = dequantize_asymmetric(codes, self.value_params[layer, slots].float(), 2).reshape(len(slots), -1)
        # tokens in the float16 window are read from it; every row reads both, so nothing waits for a count
        window = self._read_window[blocks]
        young = (window >= 0)[:, None]
        offsets = slots % self.block_size
        keys = torch.where(young, self.window_k[layer, window.clamp(min=0), offsets].float(), keys)
        values = torch.where(young, self.window_v[layer, window.clamp(min=0), offsets].float(), values)
        return keys.view(shape).to(dtype), values.view(shape).to(dtype)


def value_group(width: int) -> int:
    return VALUE_GROUP if width % VALUE_GROUP == 0 else width
