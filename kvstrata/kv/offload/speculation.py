"""Which cached tokens InfiniGen fetches for a layer, from its speculated attention logits (papers/infinigen.md
§2.3): per query head the tokens scoring above max − α; one count for every head of a sequence (the mean of
its heads' counts, floored), capped at a fraction of the sequence's cached tokens; each query head's top
tokens by that count; and per KV head the union of what its query heads chose (the rows a KV head reads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Selection:
    columns: torch.Tensor  # long [kv_heads, n, K]: columns of the group's keys each KV head reads, ascending
    valid: torch.Tensor  # bool [kv_heads, n, K]: False marks padding (heads that chose fewer than K)
    per_query_head: torch.Tensor  # long [n]: tokens each query head of a sequence chose

    def chosen(self, width: int) -> torch.Tensor:
        """float [kv_heads, n, width]: 1 at the columns each KV head reads (padding entries may repeat a column)."""
        mask = torch.zeros(*self.columns.shape[:2], width, device=self.columns.device)
        return mask.scatter_reduce_(-1, self.columns, self.valid.float(), "amax")


def select_tokens(scores: torch.Tensor, cached: torch.Tensor, alpha: float, max_fraction: float,
                  always: torch.Tensor | None = None) -> Selection:
    """scores [kv_heads, n, group, Tk]: speculated logits of each query head (grouped by KV head) against the
    keys of n sequences; cached [n, Tk]: the keys that may be chosen; always [n, Tk]: keys every KV head reads
    besides (the recent window). At least one token is chosen wherever one is cached."""
    kv_heads, n, _, width = scores.shape
    scores = scores.masked_fill(~cached[None, :, None], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    counts = (scores > top - alpha).sum(-1)  # [kv_heads, n, group]
    num_cached = cached.sum(-1)
    cap = (max_fraction * num_cached).floor().long().clamp(min=1)
    per_head = torch.minimum(counts.float().mean(dim=(0, 2)).floor().long(), cap).clamp(min=1)
    per_head = torch.minimum(per_head, num_cached)
    most = int(per_head.max()) if n else 0
    chosen = torch.zeros(kv_heads, n, width, device=scores.device)
    if always is not None:
        chosen += (always & cached)[None]
    if most > 0:
        top_columns = scores.topk(most, dim=-1).indices  # [kv_heads, n, group, most]
        keep = torch.arange(most, device=scores.device) < per_head[:, None]  # [n, most]
        chosen.scatter_reduce_(-1, top_columns.flatten(2), keep[None, :, None].expand_as(top_columns).flatten(2).float(),
                               "amax")
    fetched = chosen.sum(-1).long()  # [kv_heads, n]
    # the chosen columns packed to the front in ascending order (the host pool is then read front to back): each
    # chosen column goes to its rank among the chosen, the others to a spare last column that is dropped
    widest = int(fetched.max())
    picked = chosen.bool()
    target = torch.where(picked, picked.cumsum(-1) - 1, widest)
    everything = torch.arange(width, device=scores.device).expand_as(target)
    columns = torch.zeros(kv_heads, n, widest + 1, dtype=torch.long, device=scores.device)
    columns = columns.scatter_(-1, target, everything)[..., :widest]
    valid = torch.arange(widest, device=scores.device) < fetched[..., None]
    return Selection(columns, valid, per_head)
