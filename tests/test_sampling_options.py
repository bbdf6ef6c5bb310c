"""Sampling options beyond temperature, top-k and top-p: repetition, frequency and presence penalties, min_p,
min_tokens, allowed_token_ids, stop strings kept and special tokens shown. Against transformers' logits processors
where it has them, against OpenAI's formula where it does not, and in batches mixed with requests that use none."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import MinPLogitsWarper

from kvstrata import LLM, SamplingParams
from kvstrata.engine.penalties import Histories, penalized_logits
from kvstrata.engine.sampler import filtered_logits
from kvstrata.errors import KvstrataError
from tests.helpers import hf_greedy


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (6, 40, 17)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", chunk_size=32)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama))


def hf_generate(hf, prompt: list[int], **options) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, pad_token_id=0, **options)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_decodes_as_transformers_does_beside_unpenalized_requests(llm, hf, prompts):
    penalized = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.5)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts + prompts, [penalized] * len(prompts) + [plain] * len(prompts))
    for prompt, output in zip(prompts, outputs):
        expected = hf_generate(hf, prompt, max_new_tokens=24, eos_token_id=None, repetition_penalty=1.5)
        assert output.token_ids == expected
    for prompt, output in zip(prompts, outputs[len(prompts):]):
        assert output.token_ids == hf_greedy(hf, prompt, 24)
    assert any(a.token_ids != b.token_ids for a, b in zip(outputs, outputs[len(prompts):]))  # the penalty acted


def test_min_tokens_holds_off_the_stop_token_as_transformers_min_new_tokens_does(llm, hf, prompts):
    free = llm.generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_at = free.token_ids[1]  # the output would end at its second token
    params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at], min_tokens=6)
    out = llm.generate([prompts[1]], params)[0]
    expected = hf_generate(hf, prompts[1], max_new_tokens=20, eos_token_id=stop_at, min_new_tokens=6)
    assert out.token_ids == expected and len(out.token_ids) > 6
    assert stop_at not in out.token_ids[:6]


def test_a_stop_string_ends_the_output_only_after_min_tokens(llm):
    free = llm.generate(["Emma"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    early = free.text[:4]  # a stop string the first tokens complete
    out = llm.generate(["Emma"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[early],
                                               min_tokens=8))[0]
    assert len(out.token_ids) >= 8 and out.text.startswith(early)
    assert out.token_ids[:8] == free.token_ids[:8]
    out = llm.generate(["Emma"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[early]))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 8


def test_presence_and_frequency_penalties_follow_openai_s_formula():
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, 4.0], [1.0, -2.0, 3.0, 0.5, 4.0]])
    histories = Histories(token_ids=[[4, 1, 1, 2, 1], [4, 1, 1, 2, 1]], num_prompt=[1, 1], eos_token_ids={0})
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    out = penalized_logits(logits, params, histories)
    # The output is [1, 1, 2, 1]: token 1 three times, token 2 once; token 4 is the prompt's (not penalized).
    assert out[0].tolist() == pytest.approx([1.0, -2.0 - 0.5 - 0.75, 3.0 - 0.5 - 0.25, 0.5, 4.0])
    assert torch.equal(out[1], logits[1])  # a row without penalties is as it was


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 3.0, 1.0]])
    histories = Histories(token_ids=[[0, 1]], num_prompt=[1], eos_token_ids=set())  # 0 in the prompt, 1 output
    out = penalized_logits(logits, [SamplingParams(repetition_penalty=2.0)], histories)
    assert out[0].tolist() == pytest.approx([1.0, -4.0, 3.0, 1.0])


def test_min_tokens_bans_eos_and_stop_tokens_until_the_output_is_long_enough():
    logits = torch.zeros(3, 6)
    histories = Histories(token_ids=[[5, 3], [5, 3, 3], [5, 3]], num_prompt=[1, 1, 1], eos_token_ids={2})
    params = [SamplingParams(min_tokens=2, stop_token_ids=[4]), SamplingParams(min_tokens=2, stop_token_ids=[4]),
              SamplingParams(min_tokens=2, ignore_eos=True)]
    out = penalized_logits(logits, params, histories)
    assert torch.isinf(out[0, [2, 4]]).all() and torch.isfinite(out[0, [0, 1, 3, 5]]).all()
    assert torch.isfinite(out[1]).all()  # two output tokens already: it may end
    assert torch.isfinite(out[2]).all()  # it ignores EOS and has no stop tokens


def test_min_p_keeps_what_transformers_keeps():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen) * 3
    params = [SamplingParams(min_p=p, temperature=0.7) for p in (0.0, 0.05, 0.3, 1.0)]
    ours = filtered_logits(logits, params)
    for row, p in enumerate(params):
        theirs = logits[row: row + 1] / 0.7
        if p.min_p:
            theirs = MinPLogitsWarper(p.min_p)(None, theirs)
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(theirs[0]))
    assert int(torch.isfinite(ours[3]).sum()) == 1  # min_p 1 keeps only the likeliest


def test_min_tokens_that_would_ban_every_token_is_refused(llm, prompts):
    eos = llm.engine.outputs.eos_token_ids
    all_but_eos = [t for t in range(llm.engine.model_config.vocab_size) if t not in eos]
    with pytest.raises(KvstrataError, match="min_tokens 1 bans every token of the vocabulary"):
        llm.engine.add_request(prompts[0], SamplingParams(min_tokens=1, stop_token_ids=all_but_eos))
    out = llm.generate([prompts[0]], SamplingParams(min_tokens=1, stop_token_ids=all_but_eos, ignore_eos=True,
                                                    max_tokens=1))[0]  # EOS is not banned: only it may come
    assert out.token_ids[0] in eos


def test_penalized_sampling_is_seeded_like_any_other(llm, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.5, min_p=0.05)
    first, second = llm.generate([prompts[0], prompts[0]], [params, params])
    assert first.token_ids == second.token_ids and len(first.token_ids) == 12


@pytest.mark.parametrize("options, message", [
    ({"min_tokens": 17}, "min_tokens 17 exceeds max_tokens 16"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"min_p": 1.5}, "min_p must be in"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
])
def test_bad_values_are_refused_when_the_parameters_are_built(options, message):
    with pytest.raises(KvstrataError, match=message):
        SamplingParams(**options)


def test_allowed_token_ids_restrict_what_is_generated_and_nothing_else(llm, prompts):
    allowed = [7, 9, 11, 200]
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([prompts[0]] * 3, [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(max_tokens=8, temperature=1.0, seed=2, ignore_eos=True, allowed_token_ids=allowed),
        plain])
    assert all(t in allowed for o in outputs[:2] for t in o.token_ids)
    assert outputs[2].token_ids == llm.generate([prompts[0]], plain)[0].token_ids
    with pytest.raises(KvstrataError, match="allowed_token_ids names token 320, outside the vocabulary"):
        llm.engine.add_request(prompts[0], SamplingParams(allowed_token_ids=[5, 320]))
    with pytest.raises(KvstrataError, match="stop_token_ids names token 320, outside the vocabulary"):
        llm.engine.add_request(prompts[0], SamplingParams(stop_token_ids=[5, 320]))
    with pytest.raises(KvstrataError, match="min_tokens 2 bans every token of allowed_token_ids"):
        llm.engine.add_request(prompts[0], SamplingParams(allowed_token_ids=[5, 6], stop_token_ids=[5, 6],
                                                          min_tokens=2))


def test_stop_strings_kept_on_request_and_special_tokens_shown_on_request(llm):
    free = llm.generate(["Emma"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[5:8]
    kept = llm.generate(["Emma"], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop],
                                                include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop" and kept.text == free.text[: free.text.index(stop) + len(stop)]
    eos = next(iter(llm.engine.outputs.eos_token_ids))
    special = llm.engine.tokenizer.decode([eos], skip_special_tokens=False)
    forced = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "logit_bias": {eos: 100.0}}
    shown = llm.generate(["Emma"], SamplingParams(**forced, skip_special_tokens=False))[0]
    hidden = llm.generate(["Emma"], SamplingParams(**forced))[0]
    assert special and shown.text == special * 2 and hidden.text == ""
