"""The query sizes CacheGen weights key channels by: summed per KV channel, recorded while the engine runs."""

from __future__ import annotations

import torch

from kvstrata.config import EngineConfig
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.query_statistics import QuerySquares, recording_queries


def test_query_heads_are_added_up_per_kv_channel():
    squares = QuerySquares(num_layers=2, num_kv_heads=2, head_dim=3)
    q = torch.arange(5 * 4 * 3, dtype=torch.float32).reshape(5, 4, 3)  # 5 tokens, 4 query heads, 2 per KV head
    squares.add(1, q)
    squares.add(0, q[:2])
    expected = q.square().sum(0).view(2, 2, 3).sum(1).reshape(-1) / 5
    assert torch.allclose(squares.mean()[1], expected)
    assert torch.allclose(squares.mean()[0], q[:2].square().sum(0).view(2, 2, 3).sum(1).reshape(-1) / 2)


def test_recording_covers_every_layer_and_token_and_changes_nothing(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama)))
    policy = engine.runner.policy
    token_ids = list(range(3, 40))
    plain = compute_kv(engine, token_ids)
    with recording_queries(engine) as queries:
        recorded = compute_kv(engine, token_ids)
    assert engine.runner.policy is policy
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    config = engine.loaded.config
    assert queries.tokens.tolist() == [len(token_ids)] * config.num_layers
    mean = queries.mean()
    assert mean.shape == (config.num_layers, config.num_kv_heads * config.head_dim)
    assert (mean > 0).all()
