"""New tokens attending over a fixed context's K/V held outside the engine's cache: for measurements that
change or differentiate through the context (CacheGen's sensitivity, IMPRESS's per-layer subsets)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstrata.kv.attention_policy import AttentionPolicy
from kvstrata.kv.reference_attention import causal_attention

# (layer, q [m, heads, D], k_new [m, kv_heads, D]) -> the context tokens the layer reads, a mask [T]
ContextSelector = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class AttendOverContext(AttentionPolicy):
    """One sequence of new tokens, at the positions right after the context, attends over the context's K/V (one
    [T, kv_heads, D] pair per layer) and itself; a `select` reads only the context tokens it names per layer."""

    def __init__(self, context_k: list[torch.Tensor], context_v: list[torch.Tensor],
                 select: ContextSelector | None = None):
        super().__init__(storage=None)
        self.context_k, self.context_v, self.select = context_k, context_v, select

    def begin_step(self, batch) -> None:
        pass

    def end_step(self) -> None:
        pass

    def attention(self, layer, q, k_new, v_new, batch):
        context = self.context_k[layer].shape[0]
        key_positions = torch.arange(context + q.shape[0], device=q.device)
        k, v = self.context_k[layer], self.context_v[layer]
        if self.select is not None:
            chosen = self.select(layer, q, k_new)
            k, v = k[chosen], v[chosen]
            key_positions = torch.cat((key_positions[:context][chosen], key_positions[context:]))
        k, v = torch.cat((k, k_new)), torch.cat((v, v_new))
        q_positions = torch.arange(context, context + q.shape[0], device=q.device)[None]
        return causal_attention(q[None], k[None], v[None], q_positions, key_positions[None])[0]
