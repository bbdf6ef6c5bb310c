"""Which cached tokens InfiniGen fetches for a layer, from its speculated attention logits (papers/infinigen.md
§2.3): per query head the tokens scoring above max − α; one count for every head of a sequence (the mean of
its heads' counts, floored), capped at a fraction of the sequence's cached tokens; each query head's top
tokens by that count; and per KV head the union of what its query heads chose (the rows a KV head reads)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Selection:
    chosen: torch.Tensor  # bool [kv_heads, n, Tk]: the keys each KV head reads
    per_query_head: torch.Tensor  # long [n]: tokens each query head of a sequence chose


def select_tokens(scores: torch.Tensor, cached: torch.Tensor, alpha: float, max_fraction: float,
                  always: torch.Tensor | None = None) -> Selection:
    """scores [kv_heads, n, group, Tk]: speculated logits of each query head (grouped by KV head) against the
    keys of n sequences; cached [n, Tk]: the keys that may be chosen; always [n, Tk]: keys every KV head reads
    besides (the recent window). At least one token is chosen wherever one is cached.

    Nothing here waits for the device: the top-k takes at least as many tokens as the cap allows the widest row, and
    each sequence keeps its own count of them (on a GPU each value read back would stall the layer's launches)."""
    kv_heads, n, _, width = scores.shape
    scores = scores.masked_fill(~cached[None, :, None], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    counts = (scores > top - alpha).sum(-1)  # [kv_heads, n, group]
    num_cached = cached.sum(-1)
    cap = (max_fraction * num_cached).floor().long().clamp(min=1)
    per_head = torch.minimum(counts.float().mean(dim=(0, 2)).floor().long(), cap).clamp(min=1)
    per_head = torch.minimum(per_head, num_cached)
    # >= every per_head (+1: cap is worked out in float32, which can round up where double rounds down)
    most = min(width, math.floor(max_fraction * width) + 1) if n and width else 0
    chosen = torch.zeros(kv_heads, n, width, device=scores.device)
    if always is not None:
        chosen += (always & cached)[None]
    if most > 0:
        top_columns = scores.topk(most, dim=-1).indices  # [kv_heads, n, group, most]
        keep = torch.arange(most, device=scores.device) < per_head[:, None]  # [n, most]
        chosen.scatter_reduce_(-1, top_columns.flatten(2), keep[None, :, None].expand_as(top_columns).flatten(2).float(),
                               "amax")
    return Selection(chosen.bool(), per_head)
