"""How long the engine takes to prefill tokens: what recomputing a chunk from its text costs (adaptation.py).

A prefill's time grows with its tokens (the weights' matrix products) and with the (query, key) pairs its
attention reads, so tokens late in a long context cost more than early ones, and one average per token
understates what recomputing a chunk near the end of a long context costs. Both rates are fitted by least
squares to the engine's recent prefill steps. While those steps are too alike to tell the two apart (all at
one context length, say), one scale is fitted and split between them as the model's arithmetic splits its work
(multiply-adds per token in the weights, per pair in attention).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

MIN_SAMPLE_TOKENS = 64  # prefill tokens a step needs to tell the speed (fewer: the step's overhead dominates)
WINDOW = 16  # recent steps the rates are fitted to
MIN_SPREAD = 2.0  # pairs per token must differ by this factor among the steps to fit two rates


@dataclass(frozen=True)
class PrefillWork:
    tokens: int = 0
    pairs: int = 0  # (query, key) pairs attention reads

    @staticmethod
    def span(start: int, count: int) -> PrefillWork:
        """Prefilling tokens start .. start + count - 1 with those before cached: token i attends to i + 1 keys."""
        return PrefillWork(count, count * start + count * (count + 1) // 2)

    def __add__(self, other: PrefillWork) -> PrefillWork:
        return PrefillWork(self.tokens + other.tokens, self.pairs + other.pairs)


@dataclass
class PrefillSpeed:
    pair_cost_ratio: float = 0.0  # what a pair costs next to a token, from the model's arithmetic
    per_token: float | None = None  # seconds; None until a step was observed
    per_pair: float = 0.0
    samples: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (tokens, pairs, seconds)

    @staticmethod
    def for_model(num_layers: int, num_heads: int, head_dim: int, weights_per_token: int) -> PrefillSpeed:
        """`weights_per_token`: the weights each token's hidden state is multiplied by (all but the embeddings);
        attention multiplies each pair once for the scores and once for the values, per head and layer."""
        return PrefillSpeed(pair_cost_ratio=2 * num_layers * num_heads * head_dim / weights_per_token)

    def seconds(self, work: PrefillWork) -> float | None:
        if self.per_token is None:
            return None
        return work.tokens * self.per_token + work.pairs * self.per_pair

    def observe(self, work: PrefillWork, seconds: float) -> None:
        """A step prefilled `work` (decodes riding along are negligible next to it) in `seconds`."""
        if work.tokens < MIN_SAMPLE_TOKENS:
            return
        self.samples.append((work.tokens, work.pairs, seconds))
        tokens, pairs, times = (np.array(column, dtype=np.float64) for column in zip(*self.samples))
        ratios = pairs / tokens
        if ratios.max() >= MIN_SPREAD * ratios.min():
            (per_token, per_pair), *_ = np.linalg.lstsq(np.stack([tokens, pairs], axis=1), times, rcond=None)
            if per_token > 0 and per_pair > 0:
                self.per_token, self.per_pair = float(per_token), float(per_pair)
                return
        weighted = tokens + self.pair_cost_ratio * pairs
        scale = float(weighted @ times / (weighted @ weighted))
        self.per_token, self.per_pair = scale, scale * self.pair_cost_ratio
