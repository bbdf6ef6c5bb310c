"""Logprobs of a prompt's own tokens (`prompt_logprobs`): those transformers gives, over chunked prefills,
prefix-cache hits and preemption."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvstrata import LLM, SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.kv.preloaded import PreloadedKV
from tests.helpers import hf_logits


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(8)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (90, 1, 33, 64)]


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama))


def expected(hf, prompt: list[int], top: int) -> list[tuple[int, float, dict, range]]:
    """Per prompt token after the first: the token, its logprob, the `top` alternatives, and the ranks it may have
    (1 + the tokens likelier than it; tokens within 1e-4 of it may fall either side by rounding)."""
    log_dist = hf_logits(hf, prompt).log_softmax(-1)
    rows = []
    for q in range(1, len(prompt)):
        best = torch.topk(log_dist[q - 1], top)
        alternatives = dict(zip(best.indices.tolist(), best.values.tolist()))
        logprob = log_dist[q - 1, prompt[q]]
        surely_likelier, maybe_likelier = (int((log_dist[q - 1] > logprob + margin).sum()) for margin in (1e-4, -1e-4))
        ranks = range(surely_likelier + 1, maybe_likelier + 1)  # maybe_likelier counts the token itself
        rows.append((prompt[q], float(logprob), alternatives, ranks))
    return rows


def check(entries, hf, prompt, top):
    assert len(entries) == len(prompt) and entries[0] is None
    for entry, (token, logprob, alternatives, ranks) in zip(entries[1:], expected(hf, prompt, top)):
        assert entry.token_id == token and entry.logprob == pytest.approx(logprob, abs=1e-4)
        assert entry.rank in ranks
        assert list(entry.top) == list(alternatives)
        assert list(entry.top.values()) == pytest.approx(list(alternatives.values()), abs=1e-4)


@pytest.mark.parametrize("scheduler", ["sarathi", "prefill-first"])
def test_prompt_logprobs_are_transformers_over_chunked_prefills(tiny_llama, hf, prompts, scheduler):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", scheduler=scheduler, chunk_size=32)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=3, temperature=0.0)
    outputs = llm.generate(prompts + prompts[:1], [params] * len(prompts) + [plain])
    for prompt, output in zip(prompts, outputs):
        check(output.prompt_logprobs, hf, prompt, 2)
    assert outputs[-1].prompt_logprobs is None
    assert outputs[-1].token_ids == outputs[0].token_ids  # asking for them changes nothing else


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs_and_cached_for_others(tiny_llama, hf, prompts):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    llm.generate([prompts[0]], SamplingParams(max_tokens=2))  # its blocks are now in the prefix cache
    again = llm.generate([prompts[0]], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert again.num_cached_tokens == 0
    check(again.prompt_logprobs, hf, prompts[0], 0)
    other = prompts[3] + prompts[2]
    llm.generate([other], SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert llm.generate([other], SamplingParams(max_tokens=2))[0].num_cached_tokens > 0  # its blocks serve others


def test_a_failure_computing_one_request_s_prompt_logprobs_ends_that_request_alone(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    expected = llm.generate([prompts[2]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
    record = llm.engine.runner.record_prompt_logprobs

    def failing(rows):
        if rows.seq.request_id == "victim":
            raise RuntimeError("simulated fault")
        record(rows)

    llm.engine.runner.record_prompt_logprobs = failing
    llm.engine.add_request(prompts[0], SamplingParams(max_tokens=4, prompt_logprobs=1), request_id="victim")
    llm.engine.add_request(prompts[2], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1),
                           request_id="bystander")
    outputs = {}
    while llm.engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    assert outputs["victim"].finish_reason == "error" and "simulated fault" in outputs["victim"].error
    assert outputs["bystander"].token_ids == expected and len(outputs["bystander"].prompt_logprobs) == len(prompts[2])
    assert llm.engine.kv_manager.pool.num_used == 0


def test_a_preempted_request_keeps_its_prompt_logprobs(tiny_llama, hf, prompts):
    bytes_per_block = 16 * 2 * 3 * 2 * 16 * 4  # tokens * (K,V) * layers * kv heads * head dim * fp32
    llm = LLM(str(tiny_llama), kv_cache_memory=10 * bytes_per_block, max_model_len=128, chunk_size=32)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(prompts, params)
    assert any(o.metrics.num_preemptions for o in outputs)
    for prompt, output in zip(prompts, outputs):
        check(output.prompt_logprobs, hf, prompt, 1)


def test_prompt_logprobs_are_refused_with_preloaded_kv_and_checked(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    config = llm.engine.model_config
    kv = torch.zeros(config.num_layers, 8, config.num_kv_heads, config.head_dim)
    with pytest.raises(KvstrataError, match="prompt_logprobs needs every prompt token computed"):
        llm.engine.add_request(prompts[0], SamplingParams(prompt_logprobs=1), preloaded=[PreloadedKV(0, kv, kv)])
    with pytest.raises(KvstrataError, match="prompt_logprobs must be at most 20"):
        SamplingParams(prompt_logprobs=21)
