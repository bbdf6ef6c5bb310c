"""The default model resumed from a saved context: the near-lossless level keeps greedy output identical."""

import pytest

from kvstrata import LLM, SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def test_near_lossless_context_keeps_greedy_generation_identical(emma_text, tmp_path):
    # Float32 weights, so that no product rounds its activations: the default blocks round them to int8 in
    # products of few rows (model/block_linear.py), and through that rounding a perturbation of the KV of any size
    # moves the next token's log-probabilities by a floor of its own, which alone can flip a near tie.
    llm = LLM(threads=1, weights="fp32")
    context = llm.engine.tokenize(emma_text[20000:32000])[:1000]
    question = llm.engine.tokenize(" What did Emma think of it?")
    params = SamplingParams(max_tokens=64, temperature=0.0)
    uncompressed = llm.generate([context + question], params)[0]

    path = tmp_path / "emma.kv"
    llm.save_context(context, path, levels=["near-lossless"], chunk_tokens=400)
    llm.engine.step_stats.clear()
    resumed = llm.generate(question, params, context=path)[0]
    assert sum(s.prefill_tokens for s in llm.engine.step_stats) == len(question)  # the context was not prefilled
    assert resumed.token_ids == uncompressed.token_ids
