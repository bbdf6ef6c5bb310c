"""The one seam between the model and the KV cache (see DESIGN.md)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvstrata.kv.attention_batch import AttentionBatch


class KVPolicy(Protocol):
    def on_layer_input(self, layer: int, x: torch.Tensor, batch: AttentionBatch) -> None:
        """Called with a layer's input just before its attention (InfiniGen speculates here)."""

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """Store the step's new K/V, attend, and return the output [T, heads, head_dim]."""
        ...
