"""Our Llama-family and OPT implementations give transformers' logits on the same weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from tests.helpers import hf_logits, prefill_in_chunks

CHECKPOINTS = ["tiny_llama", "tiny_llama_tied", "tiny_qwen2", "tiny_qwen3", "tiny_phi3", "tiny_opt",
               "tiny_opt_post_norm"]


def make_engine(path, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), kv_cache_memory="8MiB", **options))


def prompt_ids(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_full_prefill_logits_match(name, request):
    path = request.getfixturevalue(name)
    ids = prompt_ids(97)
    ours, _ = prefill_in_chunks(make_engine(path), ids, chunk=len(ids))
    reference = hf_logits(AutoModelForCausalLM.from_pretrained(str(path)), ids)
    assert torch.allclose(ours, reference, atol=1e-4, rtol=0), (ours - reference).abs().max()


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3", "tiny_opt"])
@pytest.mark.parametrize("chunk", [1, 5, 16, 33])
def test_chunked_prefill_equals_full_prefill(name, chunk, request):
    path = request.getfixturevalue(name)
    engine = make_engine(path)
    ids = prompt_ids(80, seed=1)
    full, full_seq = prefill_in_chunks(engine, ids, chunk=len(ids))
    chunked, chunked_seq = prefill_in_chunks(engine, ids, chunk=chunk)
    assert torch.allclose(full, chunked, atol=1e-5, rtol=0)
    for layer in range(engine.loaded.config.num_layers):
        k_full, v_full = engine.kv_cache.read(layer, full_seq.block_table, len(ids))
        k_chunk, v_chunk = engine.kv_cache.read(layer, chunked_seq.block_table, len(ids))
        assert torch.allclose(k_full, k_chunk, atol=1e-5) and torch.allclose(v_full, v_chunk, atol=1e-5)


def test_packed_step_matches_separate_runs(tiny_llama):
    """Two prefill chunks and two decodes in one packed step give each sequence's own logits."""
    engine = make_engine(tiny_llama)
    prompts = [prompt_ids(n, seed=n) for n in (9, 23, 40, 17)]
    alone = [prefill_in_chunks(engine, p, chunk=len(p))[0][-1] for p in prompts]

    from kvstrata.engine.sampling_params import SamplingParams
    from kvstrata.engine.sequence import Sequence

    seqs = [Sequence(i, str(i), None, p, SamplingParams()) for i, p in enumerate(prompts)]
    # Bring the first two to their last token so they decode; the others prefill in one chunk.
    for seq in seqs[:2]:
        warm = seq.num_tokens - 1
        engine.kv_manager.grow(seq, warm)
        engine.runner.forward([(seq, warm)])
        seq.num_computed_tokens = warm
    work = [(seqs[2], 40), (seqs[0], 1), (seqs[3], 17), (seqs[1], 1)]
    for seq, n in work:
        engine.kv_manager.grow(seq, n)
    result = engine.runner.execute(work)
    by_id = {seq.seq_id: row for seq, row in zip(result.to_sample, result.logits)}
    for i in range(4):
        assert torch.allclose(by_id[i], alone[i], atol=1e-5), i
