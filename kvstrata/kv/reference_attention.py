"""The one exact attention function every KV policy calls on the K/V it decided to use."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    kv_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention over a cached prefix plus a new chunk.

    q: [n, Tq, heads, D]; k, v: [n, Tk, kv_heads, D] where key j sits at position j.
    q_positions: [n, Tq] absolute positions of the queries. A query at position p sees the keys
    at positions <= p, and only the first kv_lens[i] keys of sequence i (the rest is padding).
    Grouped-query attention: heads must be a multiple of kv_heads.
    Returns [n, Tq, heads, D].
    """
    key_positions = torch.arange(k.shape[1], device=k.device)
    allowed = key_positions[None, None, :] <= q_positions[:, :, None]
    if kv_lens is not None:
        allowed = allowed & (key_positions[None, None, :] < kv_lens[:, None, None])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=allowed[:, None, :, :],
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
