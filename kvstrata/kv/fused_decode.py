"""A step of decodes under full attention as one operator per layer, so that a compiled model step runs all
layers without returning to Python (DESIGN.md, "The decode step compiled whole").

Layer by layer, the model hands q, k and v to its attention policy, which stores the new K/V through its storage,
picks the keys and attends: Python between every two layers, which on a small model costs as much as the layer's
arithmetic. For the commonest step, decodes reading every cached key of a float pool, the compiled CPU kernels
register `kvstrata::store_and_decode_attention` (kv/kernels/paged_decode.cpp): store, then attend where the keys lie.
A policy that offers this (`AttentionPolicy.fused_decode`) hands the model the tensors it needs; torch.compile then
keeps the operator inside one graph of the whole step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class FusedDecode(NamedTuple):
    k_pools: torch.Tensor  # [layers, kv_heads, blocks, block, head_dim], written in place
    v_pools: torch.Tensor
    slots: torch.Tensor  # [n] the slot of each sequence's new token
    block_tables: torch.Tensor  # [n, B]
    context_lens: torch.Tensor  # [n] tokens in each sequence's cache once the new one is stored
    min_shared_tokens: int = 0  # a prefix this long or longer that the sequences share is read once for all; 0: never
    window: int = 0  # each sequence reads only its last `window` cached tokens (a sliding window); 0: all of them


def store_and_attend(layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     step: FusedDecode) -> torch.Tensor:
    """Store layer `layer`'s new K/V [n, kv_heads, head_dim] and return the attention output of q [n, heads,
    head_dim] over each sequence's cached keys."""
    return torch.ops.kvstrata.store_and_decode_attention(q, k_new, v_new, step.k_pools, step.v_pools, layer, step.slots,
                                                         step.block_tables, step.context_lens, q.shape[-1] ** -0.5,
                                                         step.min_shared_tokens, step.window)


def register_fake() -> None:
    """What the operator returns, for torch.compile's tracing (shapes only); called once the kernels are loaded.
    The schema's defaults are repeated: a traced call leaves out the trailing arguments that equal them."""

    @torch.library.register_fake("kvstrata::store_and_decode_attention")
    def _(q, k_new, v_new, k_pools, v_pools, layer, slots, block_tables, context_lens, scale, min_shared_tokens=0,
          window=0):
        return q.new_empty(q.shape)  # the kernel's output is contiguous whatever q's strides
