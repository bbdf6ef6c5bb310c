"""How large the queries that read each key channel are, measured while the engine runs text.

CacheGen weights its key quantization by it (kvstrata/cachegen/quantize.py): an error in key channel c
moves a score by q_c times that error. The engine's attention policy is wrapped for the duration of a
`recording_queries` block; the wrapper sums every query's squares (after RoPE, as attention sees them)
per layer and KV channel, a KV channel's query heads added up.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from kvstrata.kv.attention_batch import AttentionBatch
from kvstrata.kv.attention_policy import AttentionPolicy

if TYPE_CHECKING:
    from kvstrata.engine.llm_engine import LLMEngine


class QuerySquares:
    """Sums of squared queries [layers, kv_heads * head_dim] and how many tokens they cover per layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int):
        self.num_kv_heads = num_kv_heads
        self.sums = torch.zeros(num_layers, num_kv_heads * head_dim, dtype=torch.float64)
        self.tokens = torch.zeros(num_layers, dtype=torch.float64)

    def add(self, layer: int, q: torch.Tensor) -> None:
        tokens, heads, dim = q.shape
        per_query_head = q.detach().double().square().sum(dim=0)  # [heads, dim]
        per_kv_head = per_query_head.view(self.num_kv_heads, heads // self.num_kv_heads, dim).sum(dim=1)
        self.sums[layer] += per_kv_head.reshape(-1).to(self.sums.device)
        self.tokens[layer] += tokens

    def mean(self) -> torch.Tensor:
        """Mean square per (layer, KV channel) [L, C], float32."""
        if (self.tokens == 0).any():
            raise ValueError("no query was recorded for some layer")
        return (self.sums / self.tokens[:, None]).float()


class _RecordingPolicy(AttentionPolicy):
    """Delegates every call to the engine's policy and records the queries on the way."""

    def __init__(self, inner: AttentionPolicy, squares: QuerySquares):
        super().__init__(inner.storage)
        self.inner, self.squares = inner, squares

    def begin_step(self, batch: AttentionBatch) -> None:
        self.inner.begin_step(batch)

    def end_step(self) -> None:
        self.inner.end_step()

    def on_layer_input(self, layer: int, x: torch.Tensor, batch: AttentionBatch) -> None:
        self.inner.on_layer_input(layer, x, batch)

    def attention(self, layer, q, k_new, v_new, batch):
        self.squares.add(layer, q)
        return self.inner.attention(layer, q, k_new, v_new, batch)


@contextmanager
def recording_queries(engine: LLMEngine):
    """Within the block, every query the engine computes is added to the yielded QuerySquares."""
    config = engine.loaded.config
    squares = QuerySquares(config.num_layers, config.num_kv_heads, config.head_dim)
    runner = engine.runner
    inner = runner.policy
    runner.policy = _RecordingPolicy(inner, squares)
    try:
        yield squares
    finally:
        runner.policy = inner
