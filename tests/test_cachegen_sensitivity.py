"""The sensitivity CacheGen's steps come from: gradients of the later tokens' loss with respect to the cached K/V."""

from __future__ import annotations

import pytest
import torch

from kvstrata.cachegen.sensitivity import context_gradients, measure_sensitivity
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.eval.cache_scorer import CacheScorer
from kvstrata.kv.preloaded import PreloadedKV

CONTEXT = 40


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), threads=1))


def scored_loss(engine, token_ids, k, v) -> float:
    """The summed next-token loss of token_ids[CONTEXT + 1:] read through the engine's own cache, the context's
    K/V placed as given (the engine's path, not the gradient's dense one)."""
    logits = CacheScorer(engine).next_token_logits(token_ids, CONTEXT + 1, tokens_per_step=8,
                                                   preloaded=[PreloadedKV(0, k, v)])
    targets = torch.tensor(token_ids[CONTEXT + 1:])
    return torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum").item()


def test_gradients_match_finite_differences_through_the_engine(engine):
    """Moving one layer's cached K or V along a direction changes the loss read through the paged cache by the
    gradient's dot product with it (central differences)."""
    from kvstrata.engine.direct_forward import compute_kv

    token_ids = [(7 * i + 3) % 250 + 3 for i in range(CONTEXT + 24)]
    grad_k, grad_v = context_gradients(engine, token_ids, CONTEXT)
    k, v = compute_kv(engine, token_ids[:CONTEXT])
    assert grad_k.shape == k.shape and grad_v.shape == v.shape
    layer = 1
    for which, grad in (("k", grad_k), ("v", grad_v)):
        direction = torch.zeros_like(k)
        direction[layer] = torch.randn(k.shape[1:], generator=torch.Generator().manual_seed(3))
        eps = 1e-2
        moved = {sign: (k + sign * eps * direction, v) if which == "k" else (k, v + sign * eps * direction)
                 for sign in (1, -1)}
        slope = (scored_loss(engine, token_ids, *moved[1]) - scored_loss(engine, token_ids, *moved[-1])) / (2 * eps)
        expected = (grad * direction).sum().item()
        assert abs(expected) > 1e-3
        assert slope == pytest.approx(expected, rel=0.05), which


def test_sensitivity_is_a_mean_square_per_layer_and_channel(engine):
    config = engine.loaded.config
    token_ids = [(11 * i + 5) % 250 + 3 for i in range(200)]
    sensitivity_k, sensitivity_v = measure_sensitivity(engine, token_ids, windows=2, context_tokens=48,
                                                       scored_tokens=16)
    for s in (sensitivity_k, sensitivity_v):
        assert s.shape == (config.num_layers, config.num_kv_heads * config.head_dim)
        assert (s > 0).all()
    with pytest.raises(KvstrataError, match="64 tokens"):
        measure_sensitivity(engine, token_ids[:50], windows=1, context_tokens=48, scored_tokens=16)
