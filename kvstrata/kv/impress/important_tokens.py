"""Which tokens of a reused prefix a layer needs (IMPRESS §3.1-3.2, papers/impress.md).

Per layer, the new tokens' queries of a few probe heads score every prefix token as H2O does: the column sums
of their softmax rows, each row over the prefix keys and the new tokens' own keys up to itself. Each probe
head's top ceil(r * n) tokens form its important set. Where the probe heads agree (the mean pairwise Jaccard
similarity of their sets reaches t = (r / (2 - r)) ** alpha, r the actual share k / n, r / (2 - r) the value
two random sets of that size reach), one shared set serves every head of the layer; otherwise the layer reads
its whole prefix (a fallback).

A stored prefix is read in units (its chunks), so a chosen token brings its unit's other tokens along at no extra
read: `read_with` widens a choice to whole units, and the "chunks" rule chooses whole units to begin with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstrata.errors import KvstrataError

ALPHA = 0.6  # the paper's best exponent of the threshold
SHARED_SET_RULES = ("vote", "union", "first", "chunks")


def prefix_scores(q_new: torch.Tensor, prefix_k: torch.Tensor, new_k: torch.Tensor) -> torch.Tensor:
    """H2O scores [heads, n] of the n prefix tokens: q_new [m, heads, D] (after RoPE), prefix_k [n, D] and new_k
    [m, D] (the keys of the one KV head the query heads share). New token i sees the prefix and new tokens <= i."""
    m, n = q_new.shape[0], prefix_k.shape[0]
    keys = torch.cat((prefix_k, new_k)).float()
    scores = torch.einsum("mhd,td->hmt", q_new.float(), keys) * q_new.shape[-1] ** -0.5
    future = torch.arange(m)[:, None] < torch.arange(m)[None]  # new token i does not see new token j > i
    scores[:, :, n:] = scores[:, :, n:].masked_fill(future, float("-inf"))
    return scores.softmax(-1)[:, :, :n].sum(1)


def head_scores(q_new: torch.Tensor, prefix_k: torch.Tensor, new_k: torch.Tensor, heads: int) -> torch.Tensor:
    """prefix_scores of query heads 0 .. heads-1 [heads, n], each against its KV head's keys: q_new [m, H, D],
    new_k [m, G, D], prefix_k [n, G', D] holding KV heads 0 .. G'-1 (all of them, or only those the scoring heads
    read: the probe keys) (query head h reads KV head h // (H / G))."""
    group = q_new.shape[1] // new_k.shape[1]
    return torch.cat([prefix_scores(q_new[:, h : h + 1], prefix_k[:, h // group], new_k[:, h // group])
                      for h in range(heads)])


def important_count(ratio: float, num_tokens: int) -> int:
    if not 0 < ratio <= 1:
        raise KvstrataError(f"the important-token ratio must be in (0, 1], got {ratio!r}")
    return min(num_tokens, math.ceil(ratio * num_tokens))


def top_sets(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Each head's important set as a mask [heads, n]: its `count` highest-scored tokens."""
    mask = torch.zeros_like(scores, dtype=torch.bool)
    return mask.scatter_(1, scores.topk(count, dim=1).indices, True)


def mean_pairwise_jaccard(sets: torch.Tensor) -> float:
    """Mean Jaccard similarity |A & B| / |A | B| over every pair of the sets [heads, n] (1.0 for one set)."""
    heads = sets.shape[0]
    if heads < 2:
        return 1.0
    masks = sets.float()
    both = masks @ masks.T
    either = masks.sum(1)[:, None] + masks.sum(1)[None] - both
    pairs = torch.triu_indices(heads, heads, offset=1)
    similarity = both[pairs[0], pairs[1]] / either[pairs[0], pairs[1]].clamp_min(1)
    return float(similarity.mean())


def random_jaccard(share: float) -> float:
    """The Jaccard similarity two random sets of `share` of the tokens reach (ratio of expectations)."""
    return share / (2 - share)


def agreement_threshold(share: float, alpha: float = ALPHA) -> float:
    return random_jaccard(share) ** alpha


def check_rule(rule: str) -> None:
    if rule not in SHARED_SET_RULES:
        raise KvstrataError(f"shared-set rule {rule!r} is not one of {', '.join(SHARED_SET_RULES)}")


def shared_set(scores: torch.Tensor, sets: torch.Tensor, count: int, rule: str = "vote",
               units: torch.Tensor | None = None) -> torch.Tensor:
    """One important set [n] for every head of the layer from the probe heads' sets [probes, n]. "vote": the
    tokens most probe heads chose, ranked by the number of votes and then by the summed probe scores, `count` of
    them; "union": every token some probe head chose; "first": the first probe head's set; "chunks": whole read
    units (`units` [n], each token's; one per token when None), those holding the most summed probe score first,
    until they hold `count` tokens."""
    if rule == "union":
        return sets.any(0)
    if rule == "first":
        return sets[0].clone()
    if rule == "chunks":
        return _richest_units(scores.sum(0), torch.arange(sets.shape[1]) if units is None else units, count)
    check_rule(rule)
    votes = sets.sum(0).double()
    summed = scores.sum(0).double()
    rank = votes + summed / (summed.max() + 1) * 0.5  # summed scores only break ties between equal votes
    chosen = torch.zeros(sets.shape[1], dtype=torch.bool)
    chosen[rank.topk(count).indices] = True
    return chosen


def _richest_units(scores: torch.Tensor, units: torch.Tensor, count: int) -> torch.Tensor:
    """The tokens [n] of the units holding the most of `scores` [n], taken in that order until at least `count`
    tokens are."""
    units = units.long()
    mass = torch.zeros(int(units.max()) + 1, dtype=torch.float64).index_add_(0, units, scores.double())
    sizes = units.bincount(minlength=len(mass))
    order = mass.argsort(descending=True)
    taken = order[: int((sizes[order].cumsum(0) < count).sum()) + 1]
    return torch.isin(units, taken)


def read_with(tokens: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """Every token [n] of the read units (`units` [n], each token's) that hold one of `tokens` (a mask [n])."""
    return torch.isin(units, units[tokens])


@dataclass
class LayerSelection:
    """A layer's decision: `tokens` (a mask [n]) is what it reads, every prefix token when it falls back;
    `important` what its rule chose (`tokens` may add the rest of their read units)."""

    tokens: torch.Tensor
    jaccard: float
    threshold: float
    fallback: bool
    important: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.important is None:
            self.important = self.tokens


def select_layer_tokens(scores: torch.Tensor, ratio: float, alpha: float = ALPHA, rule: str = "vote",
                        units: torch.Tensor | None = None) -> LayerSelection:
    """The decision for one layer from its probe heads' scores [probes, n]; `units` [n]: each token's read unit,
    for the "chunks" rule."""
    num_tokens = scores.shape[1]
    count = important_count(ratio, num_tokens)
    sets = top_sets(scores, count)
    jaccard = mean_pairwise_jaccard(sets)
    threshold = agreement_threshold(count / num_tokens, alpha)
    if jaccard < threshold:
        return LayerSelection(torch.ones(num_tokens, dtype=torch.bool), jaccard, threshold, True)
    return LayerSelection(shared_set(scores, sets, count, rule, units), jaccard, threshold, False)
