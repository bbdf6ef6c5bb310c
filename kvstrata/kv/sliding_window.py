"""Sliding-window attention (Mistral v0.1, Phi-3-mini-4k): a query at position p reads the keys at positions
p - window + 1 .. p, as transformers masks it. `window` also tells the cache manager which blocks no later query
reads: those go back to the pool as the window moves on (KVCacheManager.release_behind_window).

A step whose every query lies within the window of position 0 reads nothing the window hides, so it runs as full
attention. Past that, a step of decodes alone reads each row's window in the one-operator step where the storage has
it (kv/fused_decode.py), and other decode rows (a row per token verifying drafts too) read only their window's keys:
in place, by the compiled readers' window, where the storage has one, else gathered; a prompt chunk reads its keys
from its first query's window on and masks what the window hides of them.
"""

from __future__ import annotations

import torch

from kvstrata.kv.attention_batch import AttentionBatch, AttentionGroup, CachedKeys
from kvstrata.kv.attention_policy import AttentionPolicy, attend_keys
from kvstrata.kv.reference_attention import attend
from kvstrata.kv.storage import KVStorage


class SlidingWindowAttention(AttentionPolicy):
    def __init__(self, storage: KVStorage, window: int):
        super().__init__(storage)
        self.window = window
        self._past_window = False  # this step has a query at position `window` or later (begin_step)
        # per group of the step: its keys, and their mask where the window hides some that causality shows
        self._keys: dict[int, tuple[CachedKeys, torch.Tensor | None]] = {}

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        self._past_window = bool((batch.positions >= self.window).any())
        self._keys = {}

    def fused_decode(self, batch, dtype):
        if len(batch.groups) != 1 or not batch.groups[0].is_decode:
            return None
        fused = self.storage.fused_decode(batch, dtype)
        return fused._replace(window=self.window) if fused is not None and self._past_window else fused

    def _attend_group(self, layer: int, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        if not self._past_window:
            return super()._attend_group(layer, q, group)
        if group.is_decode:
            out = self.storage.attend_in_place(layer, q, group.keys, group.context_lens, self.window)
            if out is not None:
                return out
        if id(group) not in self._keys:  # the same keys and mask in every layer of the step
            self._keys[id(group)] = self._window_keys(group)
        keys, mask = self._keys[id(group)]
        k, v = self.storage.gather_keys(layer, keys, q.dtype)
        if mask is None:  # the window hides nothing from this group: full attention's calls
            return attend_keys(q, k, v, group, keys)
        return attend(q.view(group.num_sequences, -1, *q.shape[1:]), k, v, mask).flatten(0, 1)

    def _window_keys(self, group: AttentionGroup) -> tuple[CachedKeys, torch.Tensor | None]:
        """The keys `group` reads: a decode row's last `window` (padding where its context is shorter), which the
        causal mask then takes as they are; for a prompt chunk, its keys from its first query's window on (all of
        them for other groups), with the causal mask less what the window hides (None where it hides nothing)."""
        keys = group.keys
        if group.is_decode:
            lens = group.context_lens
            columns = lens[:, None] - self.window + torch.arange(self.window, device=lens.device)
            return keys.take(columns.clamp(min=0), columns >= 0), None
        first = 0 if group.chunk_start is None else group.chunk_start - self.window + 1
        if first > 0:  # no query of the chunk reads a key before `first`: they are neither read nor scored
            columns = torch.arange(first, keys.width, device=group.q_positions.device)
            keys = keys.take(columns.expand(group.num_sequences, -1))
        causal = keys.mask_for(group)
        visible = keys.positions[:, None, :] > group.q_positions[:, :, None] - self.window
        return keys, (causal & visible if bool((causal & ~visible).any()) else None)
