"""Engine behaviour on a tiny random Llama: batching, schedulers, preemption, prefix cache, sampling."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvstrata import LLM, SamplingParams
from kvstrata.errors import KvstrataError
from tests.helpers import hf_greedy

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 37, 12, 64, 3, 90, 21, 48)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB")


@pytest.mark.parametrize("scheduler", ["sarathi", "prefill-first", "static"])
def test_greedy_equals_transformers_under_every_scheduler(scheduler, tiny_llama, prompts):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", scheduler=scheduler, chunk_size=32)
    outputs = llm.generate(prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(hf, prompt, 20)
        assert output.finish_reason == "length"
    stats = llm.engine.step_stats
    if scheduler == "sarathi":  # decodes rode along prefill chunks
        assert any(s.prefill_tokens and s.decode_tokens for s in stats)
    else:  # prefill steps ran alone
        assert not any(s.prefill_tokens and s.decode_tokens for s in stats)


def test_preemption_under_a_small_budget_keeps_outputs(tiny_llama, prompts, llm):
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    bytes_per_block = 16 * 2 * 3 * 2 * 16 * 4  # tokens * (K,V) * layers * kv heads * head dim * fp32
    cramped = LLM(str(tiny_llama), kv_cache_memory=10 * bytes_per_block, max_model_len=128, chunk_size=32)
    outputs = cramped.generate(prompts, GREEDY)
    assert sum(s.num_preempted for s in cramped.engine.step_stats) > 0
    assert [o.token_ids for o in outputs] == expected
    assert cramped.engine.kv_manager.pool.num_used == 0


def test_prefix_cache_hits_skip_prefill(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    prefix = prompts[5] + prompts[3]  # 154 tokens: 9 full blocks of 16
    first = llm.generate([prefix + [10, 11]], GREEDY)[0]
    second = llm.generate([prefix + [12]], GREEDY)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 144)
    again = LLM(str(tiny_llama), kv_cache_memory="8MiB", enable_prefix_caching=False)
    assert again.generate([prefix + [12]], GREEDY)[0].token_ids == second.token_ids
    assert llm.engine.kv_manager.prefix_stats.hit_tokens == 144


@pytest.mark.parametrize("scheduler", ["sarathi", "prefill-first"])
def test_a_prompt_given_several_times_at_once_is_prefilled_once(tiny_llama, prompts, scheduler):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", scheduler=scheduler, chunk_size=64)
    prompt = prompts[5] + prompts[3]  # 154 tokens: 9 full blocks of 16, then 10 tokens
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    outputs = llm.generate([prompt] * 3 + [prompts[1]], [GREEDY, GREEDY, sampled, GREEDY])
    assert sum(s.prefill_tokens for s in llm.engine.step_stats) == 154 + 2 * 10 + 37
    assert [o.num_cached_tokens for o in outputs] == [0, 144, 144, 0]
    alone = LLM(str(tiny_llama), kv_cache_memory="8MiB", enable_prefix_caching=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone.generate(
        [prompt, prompt, prompt, prompts[1]], [GREEDY, GREEDY, sampled, GREEDY])]


def test_stop_token_ids_stop_strings_and_max_tokens(llm, prompts):
    free = llm.generate([prompts[1]], GREEDY)[0]
    stop_at = free.token_ids[4]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1] and out.finish_reason == "stop"
    stop_text = free.text[5:8]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0, stop=[stop_text]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop_text)]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_streaming_deltas_add_up_to_the_final_text(llm):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=["zzz"])
    pieces = list(llm.stream("Emma Woodhouse, handsome, clever", params))
    assert pieces[-1].finished
    assert "".join(p.new_text for p in pieces) == pieces[-1].text
    assert sum(len(p.new_token_ids) for p in pieces) == 30


def test_abandoned_stream_frees_its_blocks(llm):
    stream = llm.stream("Emma", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.engine.kv_manager.pool.num_used == 0 and not llm.engine.has_unfinished_requests()


def test_abort_frees_blocks(llm, prompts):
    engine = llm.engine
    request = engine.add_request(prompts[5], GREEDY)
    engine.step()
    assert engine.kv_manager.pool.num_used > 0
    assert engine.abort(request).finish_reason == "abort"
    assert engine.kv_manager.pool.num_used == 0 and engine.abort(request) is None


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llm, prompts):
    params = SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    a = llm.generate(prompts[:3], params)
    b = llm.generate(prompts[:3], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    top1 = llm.generate(prompts[:3], SamplingParams(max_tokens=15, temperature=1.0, top_k=1, ignore_eos=True))
    greedy = llm.generate(prompts[:3], SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_logprobs_are_those_of_the_model_distribution(llm, prompts):
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for entry, token in zip(out.logprobs, out.token_ids):
        assert entry.token_id == token and len(entry.top) == 3
        assert entry.logprob == pytest.approx(max(entry.top.values()))  # greedy picks the likeliest
        assert all(v <= 0 for v in entry.top.values())


def test_logit_bias_forces_bans_and_leaves_other_requests_and_logprobs_alone(llm, prompts):
    unbiased = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    plain = llm.generate(prompts[:2], unbiased)
    forced = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True, logit_bias={7: 100.0})
    first = plain[0].token_ids[0]
    banned = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={first: -100.0})
    drawn = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logit_bias={9: 100.0})
    outputs = llm.generate([prompts[0], prompts[1], prompts[0], prompts[0]],
                           [forced, unbiased, banned, drawn])
    assert outputs[0].token_ids == [7] * 6 and outputs[3].token_ids == [9] * 6
    assert outputs[2].token_ids[0] != first
    assert outputs[1].token_ids == plain[1].token_ids  # the unbiased request in the same steps
    # logprobs are the model's own: the forced token's is what the model gives it, not its biased share
    assert outputs[0].logprobs[0].logprob < -1e-3
    assert outputs[0].logprobs[0].top == pytest.approx(plain[0].logprobs[0].top, abs=1e-4)


@pytest.mark.parametrize("bias, message", [
    ({-1: 1.0}, "logit_bias token id must be an integer >= 0"),
    ({5: 100.5}, "logit_bias of token 5 must be in"),
    ({5: float("nan")}, "logit_bias of token 5 must be in"),
    ([5], "logit_bias must map token ids to numbers"),
])
def test_bad_logit_bias_is_refused_when_the_parameters_are_built(bias, message):
    with pytest.raises(KvstrataError, match=message):
        SamplingParams(logit_bias=bias)


def test_a_logit_bias_outside_the_vocabulary_fails_its_request_before_it_runs(llm, prompts):
    with pytest.raises(KvstrataError, match="logit_bias names token 100000, outside the vocabulary"):
        llm.engine.add_request(prompts[0], SamplingParams(logit_bias={100000: 1.0}))
    assert not llm.engine.has_unfinished_requests()


def test_timings_are_reported(llm, prompts):
    out = llm.generate([prompts[2]], GREEDY)[0]
    assert 0 < out.metrics.ttft <= out.metrics.e2e and out.metrics.tpot > 0


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hello"}]
    ids = llm.chat_prompt(messages)
    rendered = llm.tokenizer.apply_chat_template(messages)
    assert rendered == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert ids == llm.tokenizer.encode(rendered, add_special_tokens=False) and ids[0] == 1
    assert llm.chat(messages, SamplingParams(max_tokens=4))[0].prompt_token_ids == ids
    begun = [*messages, {"role": "assistant", "content": "Hi"}]
    continued = llm.chat(begun, SamplingParams(max_tokens=4), continue_final_message=True)[0].prompt_token_ids
    assert continued == llm.tokenizer.encode(rendered + "Hi", add_special_tokens=False)  # the answer left open


@pytest.mark.parametrize("name", ["tiny_opt", "tiny_qwen3"])
def test_other_architectures_generate_like_transformers(name, prompts, request):
    path = request.getfixturevalue(name)
    outputs = LLM(str(path), kv_cache_memory="8MiB", chunk_size=16).generate(prompts[:4], GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(str(path))
    for prompt, output in zip(prompts[:4], outputs):
        assert output.token_ids == hf_greedy(hf, prompt, 20)


def test_the_engine_logs_its_kv_capacity_as_vllm_does(tiny_llama, caplog):
    with caplog.at_level("INFO", logger="kvstrata.engine"):
        engine = LLM(str(tiny_llama), kv_cache_memory="1MiB", max_model_len=250, kv_format="int8").engine
    blocks = engine.kv_manager.pool.num_blocks
    # a token's K and V records in each of 3 layers: int8 codes over the width (2 kv heads x 16) and a float16 scale;
    # a 250-token request takes 16 whole blocks
    assert f"KV cache: {blocks * 16:,} tokens ({blocks} blocks of 16) in int8, {3 * 2 * (32 + 2)}.0 bytes a token; " \
           f"maximum concurrency for 250-token requests: {blocks / 16:.2f}x" in caplog.text
