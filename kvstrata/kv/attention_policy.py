"""The policy half of the KV seam: which cached tokens each layer reads (DESIGN.md).

The model calls `attention(layer, q, k_new, v_new, batch)` in every layer. A policy stores the
step's new K/V through its storage, picks the keys each group of sequences reads (`select_keys`),
gathers them from storage and calls the one reference attention. A new policy (a token budget, a
speculated subset, a per-layer important set) overrides `select_keys` and, where it needs the layer's
input, `on_layer_input`; storage and the attention math stay as they are.
"""

from __future__ import annotations

import torch

from kvstrata.kv.attention_batch import AttentionBatch, AttentionGroup, CachedKeys
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.fused_decode import FusedDecode
from kvstrata.kv.preloaded import Preloaded
from kvstrata.kv.reference_attention import attend, attend_prompt_chunk, prompt_chunk_in_two_calls
from kvstrata.kv.storage import KVStorage


class AttentionPolicy:
    """Reads every cached key (full attention) unless a subclass selects fewer."""

    window: int | None = None  # a query reads only the keys of its last `window` positions; None: all of them

    def __init__(self, storage: KVStorage):
        self.storage = storage

    def begin_step(self, batch: AttentionBatch) -> None:
        self.storage.begin_step(batch)

    def end_step(self) -> None:
        self.storage.end_step()

    def on_layer_input(self, layer: int, x: torch.Tensor, batch: AttentionBatch) -> None:
        """Called with a layer's input x [T, hidden] (the residual stream, before the layer's norm) just before its
        attention: InfiniGen speculates the next layer here."""

    def attach_block_pool(self, pool: BlockPool) -> None:
        """The engine's block pool (see `KVStorage.attach_block_pool`)."""
        self.storage.attach_block_pool(pool)

    def reset_blocks(self, blocks: list[int]) -> None:
        """Blocks the pool hands out for new content (a policy with per-slot state clears it too)."""
        self.storage.reset_blocks(blocks)

    def write(self, block_table: list[int], kv: Preloaded, first: int, end: int) -> None:
        """Place ready-made KV of one sequence's positions first .. end (see `KVStorage.write`)."""
        self.storage.write(block_table, kv, first, end)

    def fused_decode(self, batch: AttentionBatch, dtype: torch.dtype) -> FusedDecode | None:
        """Where this step's attention, in every layer, is "store the new K/V, attend to every cached key" and the
        storage has one operator for it (kv/fused_decode.py): its tensors, and the model then calls no hook of
        this policy until the step ends. None: the model calls `on_layer_input` and `attention` in every layer."""
        return None

    def select_keys(self, layer: int, group: AttentionGroup) -> CachedKeys:
        """The keys `group` reads in `layer`: all of them, or a subset taken with `group.keys.take`."""
        return group.keys

    def attention(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  batch: AttentionBatch) -> torch.Tensor:
        """Store the step's new K/V, attend, and return the output [T, heads, head_dim]."""
        self.storage.store(layer, batch.slot_mapping, batch.positions, k_new, v_new)
        return outputs_of_groups(q, batch, lambda group: self._attend_group(layer, q[group.rows], group))

    def _attend_group(self, layer: int, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        keys = self.select_keys(layer, group)
        if group.is_decode and keys is group.keys:  # every cached key, whole blocks: storage may read in place
            out = self.storage.attend_in_place(layer, q, keys, group.context_lens)
            if out is not None:
                return out
        k, v = self.storage.gather_keys(layer, keys, q.dtype)
        return attend_keys(q, k, v, group, keys)


class FullAttention(AttentionPolicy):
    """Every cached token in every layer: the engine's default."""

    def fused_decode(self, batch, dtype):
        # a subclass may hook the layers (engine/layer_capture.py records them), which the fused step skips
        if type(self) is not FullAttention or len(batch.groups) != 1 or not batch.groups[0].is_decode:
            return None
        return self.storage.fused_decode(batch, dtype)


def attend_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup,
                keys: CachedKeys) -> torch.Tensor:
    """The group's queries q [T, heads, D] over `keys` (the group's or a subset), gathered as k, v [n, Tk, kv_heads,
    D], by their causal mask; a prompt chunk over every one of its keys without a mask where that is quicker
    (attend_prompt_chunk). [T, heads, D]."""
    queries = q.view(group.num_sequences, -1, *q.shape[1:])
    if keys is group.keys and group.chunk_start is not None and prompt_chunk_in_two_calls(queries):
        return attend_prompt_chunk(queries, k, v, group.chunk_start).flatten(0, 1)
    return attend(queries, k, v, keys.mask_for(group)).flatten(0, 1)


def outputs_of_groups(q: torch.Tensor, batch: AttentionBatch, attend_group) -> torch.Tensor:
    """The step's attention output [T, heads, head_dim] from `attend_group(group)` of each group: a group that holds
    every row of the step (a step of decodes alone) gives it as it is, without a copy into a new tensor."""
    if len(batch.groups) == 1 and batch.groups[0].rows == slice(0, q.shape[0]):
        return attend_group(batch.groups[0])
    out = torch.empty_like(q)
    for group in batch.groups:
        out[group.rows] = attend_group(group)
    return out
