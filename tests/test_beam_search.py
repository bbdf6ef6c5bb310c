"""Beam search (engine/beam_search.py, LLM.beam_search, the server's use_beam_search) against transformers'
generate(num_beams=...) on the same weights, and what its rounds compute."""

import dataclasses
import json
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from kvstrata import LLM, SamplingParams
from kvstrata.engine.beam_search import BeamSearch, BeamSearchParams
from kvstrata.engine.sequence import Sequence
from kvstrata.errors import KvstrataError, ParameterError
from tests.format_cases import CASES as FORMAT_CASES
from tests.format_cases import build
from tests.helpers import prefill_in_chunks
from tests.server_harness import running_server

EOS = 2  # the tiny models'
MODEL = "test-model"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval()


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def likely_stops(llm: LLM, prompt: list[int]) -> tuple[int, ...]:
    """Two tokens of the prompt's greedy continuation: as stop tokens they end many beams (the random model
    rarely picks its EOS), so the cases below finish beams early and stop early."""
    greedy = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    return tuple(sorted({greedy[2], greedy[5]} - {EOS}))


def hf_beams(hf_model, prompt: list[int], params: BeamSearchParams, ends: list[int]) -> list[list[int]]:
    """transformers' best beams' output tokens, each cut after its end token (the rest is padding)."""
    config = GenerationConfig(num_beams=params.beam_width, num_return_sequences=params.returned, do_sample=False,
                              max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
                              early_stopping=params.early_stopping, eos_token_id=ends or None, pad_token_id=0)
    with torch.inference_mode():
        rows = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 generation_config=config)
    beams = []
    for row in rows[:, len(prompt):].tolist():
        end = next((i for i, token in enumerate(row) if token in ends), len(row) - 1)
        beams.append(row[: end + 1])
    return beams


CASES = [  # width, length_penalty, early_stopping, max_tokens, returned
    (4, 1.0, False, 12, None),
    (3, 0.0, "never", 10, 2),
    (2, 2.0, True, 9, None),
    (5, -1.0, False, 14, 3),
    (3, 1.0, "never", 11, None),
]


@pytest.mark.parametrize("width, penalty, early_stopping, max_tokens, returned", CASES)
def test_beams_equal_transformers_generate_with_num_beams(llm, hf_model, width, penalty, early_stopping, max_tokens,
                                                          returned):
    finished_early = 0
    for seed in range(4):
        prompt = random_prompt(5 + 7 * seed, seed)
        stops = likely_stops(llm, prompt)
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, num_returned=returned,
                                  length_penalty=penalty, early_stopping=early_stopping, stop_token_ids=stops)
        ours = llm.beam_search(prompt, params)[0]
        assert [list(beam.token_ids) for beam in ours.sequences] == hf_beams(hf_model, prompt, params, [EOS, *stops])
        assert len(ours.sequences) == params.returned and ours.error is None
        scores = [beam.score for beam in ours.sequences]
        assert scores == sorted(scores, reverse=True)
        finished_early += sum(beam.finish_reason == "stop" for beam in ours.sequences)
    assert finished_early  # the case tested beams that end on a stop token, not only at max_tokens


def test_ignore_eos_and_texts_as_the_engine_shows_them(llm, hf_model, monkeypatch):
    """With an EOS the beams would meet (a token of the greedy continuation made the model's EOS), ignore_eos runs
    every beam to max_tokens, as transformers does with no EOS at all."""
    prompt = random_prompt(9, 11)
    likely = likely_stops(llm, prompt)
    monkeypatch.setattr(llm.engine.outputs, "eos_token_ids", set(likely))
    monkeypatch.setattr(hf_model.generation_config, "eos_token_id", None)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    ours = llm.beam_search(prompt, params)[0]
    assert [list(beam.token_ids) for beam in ours.sequences] == hf_beams(hf_model, prompt, params, [])
    assert any(set(likely) & set(beam.token_ids[:-1]) for beam in ours.sequences)  # an EOS was ignored
    for beam, text in zip(ours.sequences, ours.texts):
        assert beam.finish_reason == "length"
        assert text == llm.tokenizer.decode(list(beam.token_ids))
        assert beam.score == pytest.approx(beam.cumulative_logprob / len(beam.token_ids), rel=1e-6)


def test_width_one_is_greedy_decoding(llm):
    prompt = random_prompt(12, 3)
    greedy = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0))[0]
    beam = llm.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=10))[0].sequences[0]
    assert list(beam.token_ids) == list(greedy.token_ids)
    assert beam.finish_reason == greedy.finish_reason


def test_prompts_searched_together_give_what_each_gives_alone(llm):
    prompts = [random_prompt(n, n) for n in (4, 30, 17)]
    params = BeamSearchParams(beam_width=3, max_tokens=10, stop_token_ids=likely_stops(llm, prompts[1]))
    together = llm.beam_search(prompts, params)
    alone = [llm.beam_search(prompt, params)[0] for prompt in prompts]
    # the same beams; their logprobs agree to rounding (a packed batch's arithmetic depends on what it packs)
    assert [[b.token_ids for b in o.sequences] for o in together] == [[b.token_ids for b in o.sequences] for o in alone]
    assert [b.score for o in together for b in o.sequences] == pytest.approx(
        [b.score for o in alone for b in o.sequences], rel=1e-5)
    assert [o.texts for o in together] == [o.texts for o in alone]
    assert [o.prompt_token_ids for o in together] == prompts


def test_a_round_computes_one_token_a_beam(tiny_llama):
    """Each beam's request finds its parent's full blocks in the prefix cache and is given the KV its parent's request
    handed back for the tokens after them: after the prompt, a round computes the beams' newest tokens alone. Without
    prefix caching every round computes each beam's context up to that KV."""
    prompt = random_prompt(150, 5)
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    computed, beams = {}, {}
    for caching in (True, False):
        llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, enable_prefix_caching=caching)
        beams[caching] = [b.token_ids for b in llm.beam_search(prompt, params)[0].sequences]
        computed[caching] = sum(s.prefill_tokens + s.decode_tokens for s in llm.engine.step_stats)
    rounds_after_the_first = params.max_tokens - 1
    assert computed[True] == len(prompt) + rounds_after_the_first * params.beam_width
    assert computed[False] > len(prompt) * rounds_after_the_first * params.beam_width
    assert beams[True] == beams[False] and [len(b) for b in beams[True]] == [20] * 4


def test_a_failed_request_fails_its_search_alone(llm, monkeypatch):
    prompts = [random_prompt(8, 1), [299, *random_prompt(8, 2)]]
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    expected = llm.beam_search(prompts[0], params)[0].sequences
    engine = llm.engine
    append = engine.outputs.append_token

    def failing_for_the_marked_prompt(seq, *args):
        if seq.prompt_token_ids[0] == 299 and seq.num_prompt_tokens > 10:  # its third round
            raise RuntimeError("injected")
        return append(seq, *args)

    monkeypatch.setattr(engine.outputs, "append_token", failing_for_the_marked_prompt)
    first, second = llm.beam_search(prompts, params)
    assert [b.token_ids for b in first.sequences] == [b.token_ids for b in expected] and first.error is None
    assert second.sequences == [] and "injected" in second.error
    assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_used == 0


def round_outputs(*tops: dict[int, float]) -> list[SimpleNamespace]:
    """A round's outputs as `BeamSearch.advance` reads them: each beam's likeliest next tokens."""
    return [SimpleNamespace(num_cached_tokens=0, logprobs=[SimpleNamespace(top=top)], tail_kv=None) for top in tops]


ROUND_ONE = {2: -0.1, 5: -0.3, 6: -0.4}  # finishes [2] at -0.1, runs [5] at -0.3 and [6] at -0.4


@pytest.mark.parametrize("round_two, running_after, done", [
    # finishes [5, 2] at -0.55 (score -0.275) and runs [5, 8] at -0.5: at its length it may still beat -0.275
    (({8: -0.2, 2: -0.25, 9: -3.0}, {8: -0.3, 2: -2.0, 9: -3.0}), -0.5, {True: True, False: False, "never": False}),
    # finishes [5, 2] the same and runs [5, 8] at -0.6: only at max_tokens 10 ("never") could it beat -0.275
    (({2: -0.25, 8: -0.3, 9: -3.0}, {8: -0.3, 2: -2.0, 9: -3.0}), -0.6, {True: True, False: True, "never": False}),
])
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_early_stopping_on_hand_made_searches(early_stopping, round_two, running_after, done):
    """Width 2, end token 2, length penalty 1: two beams finished after round two, so True stops; False stops once
    the best running beam cannot beat the worst finished one at its present length, "never" at max_tokens."""
    search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=10, early_stopping=early_stopping), {2})
    assert search.alternatives == 3
    search.advance(round_outputs(ROUND_ONE), now=1.0)
    assert [b.token_ids for b in search.finished] == [(2,)] and not search.done
    search.advance(round_outputs(*round_two), now=2.0)
    assert [(b.token_ids, b.score) for b in search.best] == [((2,), pytest.approx(-0.1)),
                                                             ((5, 2), pytest.approx(-0.275))]
    assert [beam.token_ids for beam in search.running] == [(5, 8), (6, 8)]
    assert float(search.running[0].logprob) == pytest.approx(running_after)
    assert search.done == done[early_stopping] and search.first_round_end == 1.0


@pytest.mark.parametrize("fields, param", [
    ({"beam_width": 0}, "beam_width"),
    ({"beam_width": 2, "num_returned": 3}, "num_returned"),
    ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty"),
    ({"beam_width": 2, "length_penalty": 6}, "length_penalty"),
    ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_bad_parameters_are_refused_by_name(fields, param):
    with pytest.raises(ParameterError) as refused:
        BeamSearchParams(**fields)
    assert refused.value.param == param


def test_a_width_needing_more_alternatives_than_the_engine_reports_is_refused(llm):
    with pytest.raises(ParameterError, match="beam_width 19 .* 2 tokens .* 21"):
        BeamSearch([5, 6], BeamSearchParams(beam_width=19, stop_token_ids=(7,)), {EOS})
    with pytest.raises(KvstrataError, match="does not fit the context"):
        llm.beam_search([5] * 250, BeamSearchParams(beam_width=2, max_tokens=7))


def test_a_stop_token_outside_the_vocabulary_is_refused_before_the_search(llm):
    with pytest.raises(ParameterError, match="stop_token_ids names token 320, outside the vocabulary"):
        llm.beam_search([5, 6], BeamSearchParams(beam_width=2, max_tokens=3, stop_token_ids=(7, 320)))


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(str(tiny_llama), MODEL, kv_cache_memory="8MiB", max_model_len=256) as (url, _):
        yield url


def test_server_beams_are_choices_as_offline(server, llm):
    prompts = [random_prompt(6, 7), random_prompt(13, 8)]
    body = {"model": MODEL, "prompt": prompts, "use_beam_search": True, "n": 3, "max_tokens": 9,
            "length_penalty": 0.5, "early_stopping": "never", "stop_token_ids": [EOS + 1], "temperature": 0}
    reply = httpx.post(server + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    params = BeamSearchParams(beam_width=3, max_tokens=9, length_penalty=0.5, early_stopping="never",
                              stop_token_ids=(EOS + 1,))
    offline = llm.beam_search(prompts, params)
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert [c["text"] for c in choices] == [text for o in offline for text in o.texts]
    assert [c["finish_reason"] for c in choices] == [b.finish_reason for o in offline for b in o.sequences]
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == 6 + 13
    assert usage["completion_tokens"] == sum(len(b.token_ids) for o in offline for b in o.sequences)


def test_server_chat_beam_search_streams_its_beams_at_the_end(server, llm):
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": MODEL, "messages": messages, "use_beam_search": True, "n": 2, "max_tokens": 6,
            "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        texts = ["", ""]
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                import json

                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["delta"].get("content") or ""
    offline = llm.beam_search(llm.chat_prompt(messages), BeamSearchParams(beam_width=2, max_tokens=6))[0]
    assert texts == offline.texts


@pytest.mark.parametrize("fields, param", [
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "top_p": 0.9}, "top_p"),
    ({"use_beam_search": True, "logprobs": 0}, "logprobs"),
    ({"use_beam_search": True, "stop": ["."]}, "stop"),
    ({"use_beam_search": True, "guided_regex": "[0-9]+"}, "guided_regex"),
    ({"use_beam_search": True, "max_tokens": 0, "echo": True}, "max_tokens"),
    ({"use_beam_search": True, "n": 20}, "n"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ({"length_penalty": 2}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
])
def test_server_refuses_what_beam_search_would_not_follow(server, fields, param):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, **fields}
    reply = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("case", ["fp16", "int8", "int4", "kivi4", "oaken"])
def test_every_kv_format_gives_the_beams_of_rounds_that_compute_the_parents_tail(case, tiny_llama_kv64,
                                                                                  oaken_calibrations, monkeypatch):
    """A parent's tail KV, decoded and stored again for its children, gives the beams of children that compute it;
    where the format stores it unchanged a round computes a token a beam, and Oaken's rounds compute the tails."""
    prompt = random_prompt(70, 9)
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    beams, computed = {}, {}
    keeping = BeamSearch.round_params
    for tails in (True, False):
        if not tails:
            monkeypatch.setattr(BeamSearch, "round_params",
                                lambda search: dataclasses.replace(keeping(search), keep_tail_kv=False))
        llm = build(tiny_llama_kv64, oaken_calibrations, case)
        beams[tails] = [b.token_ids for b in llm.beam_search(prompt, params)[0].sequences]
        computed[tails] = sum(s.prefill_tokens + s.decode_tokens for s in llm.engine.step_stats)
    assert beams[True] == beams[False]
    fewest = len(prompt) + (params.max_tokens - 1) * params.beam_width
    assert computed[False] > fewest
    assert computed[True] == (fewest if case != "oaken" else computed[False])


@pytest.mark.parametrize("case", list(FORMAT_CASES))
def test_a_tail_stored_again_reads_back_unchanged_where_its_storage_says_so(case, tiny_llama_kv64,
                                                                            oaken_calibrations):
    llm = build(tiny_llama_kv64, oaken_calibrations, case)
    engine = llm.engine
    prompt = random_prompt(57, 4)
    _, computed = prefill_in_chunks(engine, prompt, chunk=len(prompt))
    every_layer = engine.kv_cache.read_layers(computed.block_table, 57, 40)  # all layers at once, as one by one
    for layer in range(engine.kv_cache.num_layers):
        one = engine.kv_cache.read(layer, computed.block_table, 57, 40)
        assert torch.equal(every_layer[0][layer], one[0]) and torch.equal(every_layer[1][layer], one[1])
    engine.kv_manager.free(computed)
    output = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, keep_tail_kv=True))[0]
    if not engine.kv_cache.restores_exactly(torch.float32):
        assert case.startswith("oaken") and output.tail_kv is None
        return
    tail = output.tail_kv
    assert (tail.start, tail.end) == (48, 57)
    seq = Sequence(10**6, "copy", None, prompt, SamplingParams())
    assert engine.kv_manager.grow(seq, len(prompt))
    engine.attention.write(seq.block_table, tail, tail.start, tail.end)
    for layer in range(engine.kv_cache.num_layers):
        k, v = engine.kv_cache.read(layer, seq.block_table, tail.end, tail.start)
        assert torch.equal(k.to(tail.k.dtype), tail.k[layer]) and torch.equal(v.to(tail.v.dtype), tail.v[layer])
    engine.kv_manager.free(seq)


def test_server_takes_the_values_that_ask_nothing_of_beam_search(server):
    plain = {"model": MODEL, "prompt": "x y", "use_beam_search": True, "n": 2, "max_tokens": 5}
    neutral = {**plain, "temperature": 1, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1,
               "presence_penalty": 0, "logit_bias": {}, "bad_words": [], "min_tokens": 0, "stop": [], "seed": 3}
    replies = [httpx.post(server + "/v1/completions", json=body, timeout=60) for body in (plain, neutral)]
    assert [reply.status_code for reply in replies] == [200, 200], replies[1].text
    assert replies[0].json()["choices"] == replies[1].json()["choices"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2,
            "max_tokens": 3, "logprobs": False, "top_logprobs": 0}
    assert httpx.post(server + "/v1/chat/completions", json=chat, timeout=60).status_code == 200


def test_a_client_that_leaves_stops_its_search(tiny_llama):
    """The search asks whether its client is still there between rounds: one that hung up right after sending a
    search of 240 rounds leaves the engine idle after a few."""
    with running_server(str(tiny_llama), MODEL, kv_cache_memory="8MiB", max_model_len=256) as (url, app):
        engine = app.state.async_engine.engine
        body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "use_beam_search": True, "n": 4, "max_tokens": 240,
                           "ignore_eos": True}).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        steps, quiet_since = len(engine.step_stats), time.time()
        while time.time() - quiet_since < 1.0:  # no step for a second: nothing runs
            time.sleep(0.1)
            if len(engine.step_stats) != steps:
                steps, quiet_since = len(engine.step_stats), time.time()
        assert steps < 60  # the whole search takes 240 rounds
        assert engine.kv_manager.pool.num_used == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("options, salt, handed_over", [
    ({}, None, True),
    ({"dtype": "bfloat16", "kv_format": "bf16"}, None, True),  # stored in the compute dtype: exact
    ({"dtype": "bfloat16", "kv_format": "int8"}, None, False),  # decoded int8 rounded to bfloat16: not exact
    ({"enable_prefix_caching": False}, None, False),  # the continuing request computes its context anyway
    ({"kv_offload": "h2o"}, None, False),  # evicts tokens
    ({}, "saved context", False),  # built on a saved context: must not reach blocks a prefill would build
    ({}, "tenant", True),  # a tenant's cache_salt keeps the KV apart, but it is what computing gives
])
def test_a_tail_is_handed_over_only_where_it_is_the_kv_computing_gives(tiny_llama, options, salt, handed_over):
    engine = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, **options).engine
    engine.add_request(random_prompt(40, 1),
                       SamplingParams(max_tokens=1, keep_tail_kv=True, cache_salt="a" if salt == "tenant" else None),
                       cache_salt=b"context" if salt == "saved context" else None)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.finished]
    tail = outputs[0].tail_kv
    assert (tail is not None) == handed_over
    if handed_over:
        assert (tail.start, tail.end) == (32, 40) and tail.k.dtype == getattr(torch, options.get("dtype", "float32"))
