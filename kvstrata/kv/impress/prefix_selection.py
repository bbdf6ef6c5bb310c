"""Per-layer choice of the prefix tokens a request's new tokens read, as a `ContextSelector` for
`AttendOverContext`: IMPRESS (the probe heads' check, then one shared set or the whole prefix) or the keys-only
H2O baseline (every head scores with all of the layer's keys; the summed scores' top set, never a fallback)."""

from __future__ import annotations

import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv.impress.important_tokens import (
    ALPHA,
    LayerSelection,
    check_rule,
    head_scores,
    important_count,
    read_with,
    select_layer_tokens,
)

PREFIX_LOADING = ("impress", "h2o-keys")
ATTENDED = ("read", "chosen")  # a layer attends every token of the units it read, or only those it chose
PROBE_HEADS = 3  # the paper's number: one head may be biased, two cannot outvote each other


def probe_heads(heads: int, kv_heads: int) -> int:
    """How many query heads (0 .. n-1) probe: with grouped KV heads, those of KV head 0 (their keys are one KV
    head's, read once); with one KV head per query head, the paper's three."""
    return heads // kv_heads if kv_heads < heads else min(PROBE_HEADS, heads)


def probe_kv_heads(heads: int, kv_heads: int) -> int:
    """How many KV heads (0 .. n-1) the probe heads read: 1 with grouped KV heads, 3 with one per query head."""
    return len({head // (heads // kv_heads) for head in range(probe_heads(heads, kv_heads))})


class PrefixSelector:
    """Chooses from the first `selection_rows` new tokens (the request's prompt; later rows are its continuation,
    which reads what the prompt chose). Every layer's decision is kept in `decisions`. `context_k[layer]` is what
    the layer's scores read: the prefix's keys [n, kv_heads, D], or for IMPRESS only the probe KV heads' [n, p, D]
    (it may be a sequence that loads a layer's keys when asked). `read_units[layer]`, when given, is the unit
    (stored chunk) each prefix token is read in [n]: the "chunks" rule chooses whole units, and with `attend`
    "read" a layer reads every token of the units holding its choice (they cost no extra read)."""

    def __init__(self, context_k, method: str, ratio: float, selection_rows: int,
                 alpha: float = ALPHA, rule: str = "vote", read_units=None, attend: str = "chosen"):
        if method not in PREFIX_LOADING:
            raise KvstrataError(f"prefix loading {method!r} is not one of {', '.join(PREFIX_LOADING)}")
        check_rule(rule)
        if attend not in ATTENDED:
            raise KvstrataError(f"the attended prefix tokens {attend!r} are not one of {', '.join(ATTENDED)}")
        if selection_rows < 1:
            raise KvstrataError(f"the selection needs at least one new token, got {selection_rows}")
        important_count(ratio, 1)  # checks the ratio
        self.context_k, self.method, self.ratio, self.alpha, self.rule = context_k, method, ratio, alpha, rule
        self.selection_rows = selection_rows
        self.read_units, self.attend = read_units, attend
        self.decisions: dict[int, LayerSelection] = {}
        self.token_scores: dict[int, torch.Tensor] = {}  # per layer, the scores [n] the choice ranked by

    def __call__(self, layer: int, q: torch.Tensor, k_new: torch.Tensor) -> torch.Tensor:
        rows = slice(0, self.selection_rows)
        units = None if self.read_units is None else self.read_units[layer]
        if self.method == "impress":
            probes = probe_heads(q.shape[1], k_new.shape[1])
            scores = head_scores(q[rows], self.context_k[layer], k_new[rows], probes)
            decision = select_layer_tokens(scores, self.ratio, self.alpha, self.rule, units)
            self.token_scores[layer] = scores.sum(0)
        else:
            scores = head_scores(q[rows], self.context_k[layer], k_new[rows], q.shape[1]).sum(0)
            self.token_scores[layer] = scores
            chosen = torch.zeros(len(scores), dtype=torch.bool)
            chosen[scores.topk(important_count(self.ratio, len(scores))).indices] = True
            decision = LayerSelection(chosen, jaccard=1.0, threshold=0.0, fallback=False)
        if self.attend == "read" and units is not None:
            decision.tokens = read_with(decision.important, units)
        self.decisions[layer] = decision
        return decision.tokens.to(q.device)

    def read_share(self, heads: int, kv_heads: int) -> float:
        """The share of the prefix's K and V bytes the decisions read (derived from them, nothing is loaded here):
        IMPRESS reads its probe heads' keys, then K and V of the tokens it reads (or all of them); keys-only H2O
        reads every key, then the values of the tokens it reads. With `read_units`, a token read is its whole
        unit read."""
        probe = probe_kv_heads(heads, kv_heads) / (2 * kv_heads)
        shares = []
        for layer, decision in self.decisions.items():
            tokens = decision.tokens if self.read_units is None else read_with(decision.tokens, self.read_units[layer])
            read = float(tokens.float().mean())
            if self.method == "impress":
                shares.append(1.0 if decision.fallback else probe + read * (1 - probe))
            else:
                shares.append(0.5 + 0.5 * read)
        return sum(shares) / len(shares)
