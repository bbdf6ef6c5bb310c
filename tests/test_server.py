"""The HTTP server on a tiny model: OpenAI shapes, errors, back-pressure, disconnects, shutdown."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata import LLM, SamplingParams
from kvstrata.bench.serve import wait_healthy
from kvstrata.server.options import ServerOptions
from tests.server_harness import free_port, running_server
from tests.tiny_models import VOCAB_SIZE

pytestmark = pytest.mark.slow

MODEL = "test-model"


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(str(tiny_llama), MODEL, kv_cache_memory="8MiB", max_model_len=256) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256)


def wait_idle(app, timeout=30.0):
    engine = app.state.async_engine
    deadline = time.time() + timeout
    while time.time() < deadline and (engine.num_in_flight or engine.engine.has_unfinished_requests()):
        time.sleep(0.05)
    return engine.engine


def test_usage_counts_the_prompt_tokens_whose_kv_was_reused(client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: the prompt's full blocks the prefix cache served (its
    last token is always computed)."""
    prompt = "Usage of a prompt never sent before: Highbury, Hartfield, Randalls, Donwell Abbey and Box Hill. " * 2
    first, second = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=1) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (second.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_completion_matches_offline_generate(client, offline):
    expected = offline.generate(["Emma Woodhouse, handsome"], SamplingParams(max_tokens=12, temperature=0))[0]
    reply = client.completions.create(model=MODEL, prompt="Emma Woodhouse, handsome", max_tokens=12, temperature=0)
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    streamed = client.completions.create(
        model=MODEL, prompt="Emma Woodhouse, handsome", max_tokens=12, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_matches_offline_chat(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Emma?"}]
    expected = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0))[0]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == expected.text and reply.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_sampling_options_and_logprobs(client):
    a = client.completions.create(model=MODEL, prompt="Emma", max_tokens=8, temperature=1.0, top_p=0.9, seed=7,
                                  extra_body={"top_k": 20})
    b = client.completions.create(model=MODEL, prompt="Emma", max_tokens=8, temperature=1.0, top_p=0.9, seed=7,
                                  extra_body={"top_k": 20})
    assert a.choices[0].text == b.choices[0].text
    scored = client.completions.create(model=MODEL, prompt="Emma", max_tokens=4, temperature=0, logprobs=2)
    assert len(scored.choices[0].logprobs.token_logprobs) == 4
    assert all(len(top) == 2 for top in scored.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    assert len(chat.choices[0].logprobs.content) == 3
    free = client.completions.create(model=MODEL, prompt="Emma", max_tokens=12, temperature=0).choices[0].text
    stop = free[3:6]
    stopped = client.completions.create(model=MODEL, prompt="Emma", max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == free[: free.index(stop)] and stopped.choices[0].finish_reason == "stop"


def test_logit_bias_is_applied_as_offline(client, offline):
    params = SamplingParams(max_tokens=5, temperature=0, logit_bias={7: 100.0, 11: 5.0})
    expected = offline.generate(["Emma"], params)[0]
    assert expected.token_ids == [7] * 5
    reply = client.completions.create(model=MODEL, prompt="Emma", max_tokens=5, temperature=0,
                                      logit_bias={"7": 100, "11": 5})
    assert reply.choices[0].text == expected.text
    messages = [{"role": "user", "content": "Hi"}]
    expected = offline.chat(messages, SamplingParams(max_tokens=3, temperature=0, logit_bias={7: 100.0}))[0]
    assert expected.token_ids == [7] * 3
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                          logit_bias={"7": 100})
    assert chat.choices[0].message.content == expected.text


def test_models_health_and_metrics(server, client):
    url, app = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # a 404 before: no route for one model
    with pytest.raises(openai.NotFoundError, match="model 'other' does not exist; this server has 'test-model'"):
        client.models.retrieve("other")
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    before = _metric(url, "kvstrata:generation_tokens_total")
    reply = client.completions.create(model=MODEL, prompt="Emma", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    wait_idle(app)
    assert _metric(url, "kvstrata:generation_tokens_total") - before == reply.usage.completion_tokens == 5
    text = httpx.get(url + "/metrics").text
    for name in ("kvstrata:num_requests_running", "kvstrata:num_requests_waiting", "kvstrata:kv_cache_usage_perc",
                 "kvstrata:prefix_cache_hit_rate", "kvstrata:prompt_tokens_total", "kvstrata:num_preemptions_total",
                 "kvstrata:time_to_first_token_seconds_bucket", "kvstrata:inter_token_latency_seconds_bucket",
                 "kvstrata:e2e_request_latency_seconds_bucket", "kvstrata:request_success_total"):
        assert name in text


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": 5}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "n": 129}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2, "top_k": 10**30}, 200, None),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [1] * 250, "max_tokens": 7}, 400, "max_tokens"),  # 250 + 7 > 256
        ({"model": MODEL, "prompt": [1] * 250, "max_tokens": 6}, 200, None),
        ({"model": MODEL, "prompt": [1] * 250}, 200, None),  # the default 16 bows to the context
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": "Emma " * 300}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt"),
        ({"model": MODEL, "prompt": ["x", "Emma " * 300]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[1, 2], [3, 99999]]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[1, 2], []]}, 400, "prompt.1"),
        ({"model": MODEL, "prompt": [[1] * 20, [1] * 250], "max_tokens": 7}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": ["x"] * 129}, 400, "prompt"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"seven": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"7": 101}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "x", "logit_bias": [7]}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "x", "best_of": 2}, 400, "best_of"),
        ({"model": MODEL, "prompt": "x", "suffix": "end"}, 400, "suffix"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
        ({"model": MODEL, "prompt": [1] * 250, "min_tokens": 7}, 400, "min_tokens"),  # the default cut to 6
        ({"model": MODEL, "prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
        ({"model": MODEL, "prompt": "x", "min_tokens": 1, "stop_token_ids": list(range(VOCAB_SIZE))}, 400,
         "min_tokens"),
        ({"model": MODEL, "prompt": "x", "stop_token_ids": [5, VOCAB_SIZE]}, 400, "stop_token_ids"),
        ({"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
        ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
        ({"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids.0"),
        ({"model": MODEL, "prompt": "x", "allowed_token_ids": [5, 99999]}, 400, "allowed_token_ids"),
        ({"model": MODEL, "prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
        ({"model": MODEL, "prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json"),  # no "{" token
        ({"model": MODEL, "prompt": "x", "guided_json": {"type": "no such type"}}, 400, "guided_json"),
        ({"model": MODEL, "prompt": "x", "guided_json": "{not json"}, 400, "guided_json"),
        ({"model": MODEL, "prompt": "x", "guided_regex": "[0-9"}, 400, "guided_regex"),
        ({"model": MODEL, "prompt": "x", "guided_choice": []}, 400, "guided_choice"),
        ({"model": MODEL, "prompt": "x", "guided_grammar": "root ::= ("}, 400, "guided_grammar"),
        ({"model": MODEL, "prompt": "x", "guided_regex": "a+", "guided_choice": ["b"]}, 400, "guided_choice"),
        ({"model": MODEL, "prompt": "x", "guided_regex": "a+", "structured_outputs": {"choice": ["b"]}}, 400,
         "guided_regex"),
        ({"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, 400,
         "structured_outputs.whitespace_pattern"),
        ({"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, 400,
         "structured_outputs"),  # JSON only
        ({"model": MODEL, "prompt": "x", "structured_outputs": {}}, 400, "structured_outputs"),
        ({"model": MODEL, "prompt": "x", "structured_outputs": {"name": "x", "regex": "a"}}, 400,
         "structured_outputs.name"),
        ({"model": MODEL, "prompt": "x", "structural_tag": "{}"}, 400, "structural_tag"),
        ({"model": MODEL, "prompt": "x", "guided_whitespace_pattern": " "}, 400, "guided_whitespace_pattern"),
        ({"model": MODEL, "prompt": "x", "guided_regex": "a+", "min_tokens": 1}, 400, "min_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "[0-9]+"}, 200, None),
        ({"model": MODEL, "prompt": "x", "max_tokens": 4, "response_format": {"type": "text"},
          "guided_choice": ["yes", "no"]}, 200, None),
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": 2, "echo": True, "logprobs": 1}, 400,
         "prompt_logprobs"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2, "use_beam_search": True}, 200, None),
        ({"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop"),
        ({"model": MODEL, "prompt": "x", "bad_words": ["Emma", " "]}, 400, "bad_words.1"),
        ({"model": MODEL, "prompt": "x", "bad_words": ["Emma"], "guided_regex": "a+"}, 400, "bad_words"),
        ({"model": MODEL, "prompt": "x", "bad_words": ["Emma"] * 1025}, 400, "bad_words"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2, "guided_choice": None, "use_beam_search": False,
          "bad_words": ["Emma", " Knightley"], "length_penalty": 1}, 200, None),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2, "allowed_token_ids": [5], "include_stop_str_in_output": True,
          "skip_special_tokens": False}, 200, None),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2, "best_of": 1, "suffix": "", "min_tokens": 0, "min_p": 0,
          "repetition_penalty": 1, "stop_token_ids": [], "user": "anyone"}, 200, None),
        ({"model": MODEL, "prompt": "x", "max_tokens": 3, "min_tokens": 3, "min_p": 0.1, "repetition_penalty": 1.3,
          "presence_penalty": -2, "frequency_penalty": 2}, 200, None),
    ],
)
def test_completion_request_validation(server, body, status, param):
    reply = httpx.post(server[0] + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == status
    if status != 200:
        error = reply.json()["error"]
        assert error["param"] == param and error["message"] and error["type"]


@pytest.mark.parametrize("fields, status, param", [
    ({"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}}, 400, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),  # auto: no parser
    ({"functions": [{"name": "f"}]}, 400, "functions"),
    ({"response_format": {"type": "text"}, "tools": [], "max_tokens": 2}, 200, None),
])
def test_chat_features_the_engine_lacks_are_refused_not_ignored(server, fields, status, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    reply = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == status
    if status != 200:
        assert reply.json()["error"]["param"] == param and reply.json()["error"]["message"]


def test_n_samples_are_choices_as_offline_with_their_seeds_and_share_the_prompt(server, client, offline):
    prompt = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, " * 2
    expected = [offline.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=40 + i))[0]
                for i in range(3)]
    assert len({o.text for o in expected}) > 1
    engine = server[1].state.async_engine.engine
    hits = engine.kv_manager.prefix_stats.hit_tokens
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=40, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [o.text for o in expected]
    assert reply.usage.prompt_tokens == len(expected[0].prompt_token_ids)
    assert reply.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    full_blocks = (len(expected[0].prompt_token_ids) - 1) // 16
    assert engine.kv_manager.prefix_stats.hit_tokens - hits >= 2 * 16 * full_blocks  # samples 1 and 2 read 0's
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=40,
                                              n=3, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for chunk in streamed[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
    assert texts == [o.text for o in expected]
    assert streamed[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_a_batch_of_prompts_gives_n_choices_per_prompt_in_order(server, client, offline):
    prompts = ["Emma Woodhouse, handsome", "Harriet Smith was"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=1.0, seed=3, n=2)
    expected = [offline.generate([p], SamplingParams(max_tokens=5, temperature=1.0, seed=3 + i))[0]
                for p in prompts for i in range(2)]  # choice p * n + i: prompt p, sample i
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [o.text for o in expected]
    assert reply.usage.prompt_tokens == len(expected[0].prompt_token_ids) + len(expected[2].prompt_token_ids)
    assert reply.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    streamed = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=1.0, seed=3, n=2,
                                         stream=True)
    texts = [""] * 4
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [o.text for o in expected]
    token_batch = [[5, 6, 7, 8, 9], [10, 11, 12]]
    greedy = offline.generate(token_batch, SamplingParams(max_tokens=4, temperature=0))
    reply = client.completions.create(model=MODEL, prompt=token_batch, max_tokens=4, temperature=0)
    assert [c.text for c in reply.choices] == [o.text for o in greedy] and reply.usage.prompt_tokens == 8
    message = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": ["x", "Emma " * 300]},
                         timeout=60).json()["error"]["message"]
    assert message.startswith("prompt 1 of the batch")


def test_chat_n_streams_each_choice_from_its_role(client, offline):
    messages = [{"role": "user", "content": "Who is Emma?"}]
    expected = [offline.chat(messages, SamplingParams(max_tokens=5, temperature=0.8, seed=9 + i))[0] for i in range(2)]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.8, seed=9, n=2,
                                           logprobs=True)
    assert [c.message.content for c in reply.choices] == [o.text for o in expected]
    assert [len(c.logprobs.content) for c in reply.choices] == [len(o.token_ids) for o in expected]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.8,
                                                 seed=9, n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [o.text for o in expected]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length", "length"]


def test_stop_token_ids_end_generation_as_offline(client, offline):
    free = offline.generate(["Emma"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[free.token_ids[2]])
    expected = offline.generate(["Emma"], params)[0]
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 8
    reply = client.completions.create(model=MODEL, prompt="Emma", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "stop_token_ids": [free.token_ids[2]]})
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "stop"


def test_bad_bodies(server):
    url = server[0]
    assert httpx.post(url + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"}).status_code == 400
    assert httpx.post(url + "/v1/completions", json=[1, 2]).status_code == 400
    reply = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages.0.role"
    assert httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []}).status_code == 400
    assert httpx.get(url + "/v1/nothing").status_code == 404


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "stream", "logprobs", "top_logprobs", "stream_options", "max_completion_tokens", "ignore_eos", "echo",
          "logit_bias", "best_of", "suffix", "min_tokens", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
          "truncate_prompt_tokens", "stop_token_ids",
          "response_format", "tools", "functions", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "tool_choice"]


def _edge_body():
    """Mostly-valid bodies with one or more fields replaced by arbitrary JSON."""
    base = st.fixed_dictionaries({
        "model": st.just(MODEL),
        "prompt": st.text(max_size=40),
        "messages": st.just([{"role": "user", "content": "hi"}]),
        "max_tokens": st.integers(1, 4),
    })
    overrides = st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=3)
    return st.builds(lambda b, o: {**b, **o}, base, overrides) | JSON_VALUES


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=_edge_body(), chat=st.booleans(), raw=st.booleans())
def test_no_input_produces_a_server_error(server, body, chat, raw):
    url = server[0] + ("/v1/chat/completions" if chat else "/v1/completions")
    if raw:  # also bytes that are not JSON at all
        reply = httpx.post(url, content=json.dumps(body)[:-1].encode() or b"{", timeout=60,
                           headers={"content-type": "application/json"})
    else:
        reply = httpx.post(url, json=body, timeout=60)
    assert reply.status_code < 500, reply.text
    if reply.status_code >= 400:
        assert reply.json()["error"]["message"]


def test_server_still_correct_after_the_fuzzing(client, offline):
    """Runs after the property test in file order."""
    expected = offline.generate(["Emma"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert client.completions.create(model=MODEL, prompt="Emma", max_tokens=6, temperature=0).choices[0].text == expected.text


def test_disconnected_clients_leave_no_blocks_in_use(server):
    url, app = server
    aborted = 'kvstrata:request_success_total{finished_reason="abort",model_name="test-model"}'
    aborts_before = _metric_line(url, aborted)

    async def hang_up_mid_stream(n: int):
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"model": MODEL, "prompt": "Emma Woodhouse", "max_tokens": 200, "stream": True, "ignore_eos": True,
                    "n": n}
            async with http.stream("POST", url + "/v1/completions", json=body) as response:
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        return  # closes the connection mid-stream

    async def twenty():
        await asyncio.gather(*(hang_up_mid_stream(1 + i % 3) for i in range(20)))

    asyncio.run(twenty())
    engine = wait_idle(app)
    assert engine.kv_manager.pool.num_used == 0
    assert not engine.has_unfinished_requests()
    assert _metric_line(url, aborted) - aborts_before == 7 * 1 + 7 * 2 + 6 * 3  # every choice of every request


def _metric_line(url: str, series: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_full_queue_answers_503_with_a_retry_hint(tiny_llama):
    with running_server(str(tiny_llama), MODEL, ServerOptions(max_waiting=1), kv_cache_memory="8MiB", max_model_len=256,
                        max_num_seqs=1) as (url, app):
        async def burst():
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"model": MODEL, "prompt": "Emma", "max_tokens": 60, "ignore_eos": True}
                return await asyncio.gather(*(http.post(url + "/v1/completions", json=body) for _ in range(8)))

        replies = asyncio.run(burst())
        codes = sorted(r.status_code for r in replies)
        assert 200 in codes and 503 in codes and set(codes) <= {200, 503}
        busy = next(r for r in replies if r.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "server_overloaded"
        assert wait_idle(app).kv_manager.pool.num_used == 0
        never = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Emma", "n": 2}, timeout=60)
        assert never.status_code == 400 and never.json()["error"]["param"] == "n"  # 2 choices never fit 1 slot
        never = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}, timeout=60)
        assert never.status_code == 400 and never.json()["error"]["param"] == "prompt"


def test_sigterm_finishes_in_flight_requests_and_exits_zero(tiny_llama):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", str(tiny_llama), "--port", str(port),
         "--kv-cache-memory", "8MiB", "--max-model-len", "256", "--served-model-name", MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        body = {"model": MODEL, "prompt": "Emma", "max_tokens": 150, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(next(line for line in reversed(rest) if line.startswith("data: {"))[6:])
        assert final["choices"][0]["finish_reason"] in ("length", "abort")
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.real_model
@pytest.mark.parametrize("kv_format", [None, "oaken"])
def test_default_model_greedy_over_http_equals_generate(kv_format):
    prompts = ["The capital of France is", "Emma Woodhouse, handsome, clever, and rich,"]
    offline = LLM(kv_cache_memory="512MiB", kv_format=kv_format)
    # One prompt at a time, as the requests below arrive: batched matmuls round differently, and a quantized
    # cache can turn such a difference into another code.
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    expected = [offline.generate([prompt], greedy)[0] for prompt in prompts]
    del offline
    with running_server(None, MODEL, kv_cache_memory="512MiB", kv_format=kv_format) as (url, _):
        http = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for prompt, want in zip(prompts, expected):
            got = http.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert got.choices[0].text == want.text and got.usage.completion_tokens == 32


def test_bench_serve_reports_consistent_figures(server, tmp_path):
    import argparse

    from kvstrata.bench.serve import add_bench_serve_arguments, benchmark_server, plot_latencies

    parser = argparse.ArgumentParser()
    add_bench_serve_arguments(parser)
    args = parser.parse_args(["--base-url", server[0], "--num-prompts", "6", "--request-rate", "50",
                              "--prompt-len", "16", "--output-len", "5", "--goodput", "ttft:60000", "--json"])
    report, results = benchmark_server(args)
    assert report["completed"] == 6 and report["failed"] == 0 and report["model"] == MODEL and report["machine"]["cores"]
    assert report["total_output_tokens"] == 30 and len(results) == 6
    assert report["request_goodput"] == report["request_throughput"]  # every request met the objective
    assert 0 < report["p50_ttft_ms"] <= report["p99_ttft_ms"] and report["median_e2el_ms"] >= report["median_ttft_ms"]
    assert all(len(r.itl) <= 4 and r.ttft + sum(r.itl) <= r.e2e for r in results)
    plot_latencies(results, tmp_path / "serve.png", "test")
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"


def test_tokenize_gives_the_tokens_the_completion_endpoints_use_and_detokenize_reverses_it(server, client):
    url = server[0]
    reply = client.completions.create(model=MODEL, prompt="Emma Woodhouse, handsome", max_tokens=1)
    tokens = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Emma Woodhouse, handsome"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == reply.usage.prompt_tokens and tokens["max_model_len"] == 256
    text = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("Emma Woodhouse, handsome")  # the BOS's text before it, where the model adds one
    again = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
    assert again["tokens"] == tokens["tokens"]
    messages = [{"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    chat_tokens = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert chat_tokens["count"] == chat.usage.prompt_tokens
    opened = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages,
                                                 "add_generation_prompt": False}).json()
    assert opened["count"] < chat_tokens["count"]


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt"),
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ("/detokenize", {"model": MODEL, "tokens": [1, 99999]}, 400, "tokens.1"),
        ("/detokenize", {"model": MODEL, "tokens": []}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
    ],
)
def test_tokenize_and_detokenize_refuse_bad_bodies(server, path, body, status, param):
    reply = httpx.post(server[0] + path, json=body, timeout=60)
    assert reply.status_code == status
    assert reply.json()["error"]["param"] == param and reply.json()["error"]["message"]


def test_echo_returns_the_prompt_with_its_logprobs_as_lm_eval_reads_them(server, client, offline):
    prompt = "Emma Woodhouse, handsome, clever"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
    ids = offline.engine.tokenize(prompt)
    expected = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    for body_prompt in (prompt, ids):
        reply = httpx.post(server[0] + "/v1/completions", json={
            "model": MODEL, "prompt": body_prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1,
            "n": 2}, timeout=60).json()
        for choice in reply["choices"]:
            logprobs = choice["logprobs"]
            assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
            assert logprobs["top_logprobs"][0] is None
            for token, top in zip(logprobs["tokens"][1:], logprobs["top_logprobs"][1:]):
                assert token in top and 1 <= len(top) <= 2  # the likeliest, and the token when it is not that
            prompt_part = logprobs["token_logprobs"][1 : len(ids)]
            assert prompt_part == pytest.approx([e.logprob for e in expected.prompt_logprobs[1:]], abs=1e-4)
        assert reply["usage"]["prompt_tokens"] == len(ids)
    assert not echoed.choices[0].logprobs  # no logprobs asked: none echoed


def test_vllm_s_prompt_logprobs_field_gives_each_prompt_token_its_logprob_rank_and_alternatives(server, offline):
    prompt = "Emma Woodhouse, handsome, clever"
    ids = offline.engine.tokenize(prompt)
    expected = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    completion = httpx.post(server[0] + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2, "n": 2},
        timeout=60).json()
    chat_prompt = offline.chat_prompt([{"role": "user", "content": prompt}])
    expected_chat = offline.generate([chat_prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    chat = httpx.post(server[0] + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "prompt_logprobs": 2},
        timeout=60).json()
    for entries, want in [(choice["prompt_logprobs"], expected) for choice in completion["choices"]] + [
            (chat["prompt_logprobs"], expected_chat)]:
        assert len(entries) == len(want.prompt_token_ids) and entries[0] is None
        for entry, token, wanted in zip(entries[1:], want.prompt_token_ids[1:], want.prompt_logprobs[1:]):
            assert entry[str(token)]["logprob"] == pytest.approx(wanted.logprob, abs=1e-4)
            assert entry[str(token)]["rank"] == wanted.rank >= 1
            assert entry[str(token)]["decoded_token"] == offline.engine.tokenizer.decode([token], False)
            alternatives = [e for t, e in entry.items() if t != str(token) or wanted.rank <= 2]
            assert sorted(e["rank"] for e in alternatives) == [1, 2]  # the two likeliest, ranked
    assert "prompt_logprobs" not in httpx.post(server[0] + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=60).json()["choices"][0]


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(server, offline):
    long_prompt = "Emma Woodhouse, handsome, clever, and rich. " * 40  # longer than the 256-token context
    ids = offline.engine.tokenize(long_prompt)
    assert len(ids) > 256
    for path, body in (("/v1/completions", {"prompt": long_prompt}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]})):
        refused = httpx.post(server[0] + path, json={"model": MODEL, **body, "max_tokens": 2}, timeout=60)
        assert refused.status_code == 400
        reply = httpx.post(server[0] + path, json={"model": MODEL, **body, "max_tokens": 2, "temperature": 0,
                                                   "truncate_prompt_tokens": 50}, timeout=60).json()
        assert reply["usage"]["prompt_tokens"] == 50
    expected = offline.generate([ids[-50:]], SamplingParams(max_tokens=4, temperature=0))[0]
    reply = httpx.post(server[0] + "/v1/completions", json={
        "model": MODEL, "prompt": long_prompt, "max_tokens": 4, "temperature": 0, "truncate_prompt_tokens": 50,
        "echo": True}, timeout=60).json()
    echoed = offline.engine.tokenizer.decode(ids[-50:], skip_special_tokens=False)
    assert reply["choices"][0]["text"] == echoed + expected.text  # what was kept of the prompt is echoed


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, offline):
    prompt = "Emma Woodhouse, handsome, clever"
    ids = offline.engine.tokenize(prompt)
    expected = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    reply = httpx.post(server[0] + "/v1/completions", json=body, timeout=60).json()
    choice = reply["choices"][0]
    assert choice["text"] == prompt and len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([e.logprob for e in expected.prompt_logprobs[1:]],
                                                                     abs=1e-4)
    assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                              "prompt_tokens_details": {"cached_tokens": 0}}
    with httpx.stream("POST", server[0] + "/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == prompt
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events) == len(ids)
    refused = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_continue_final_message_leaves_the_assistant_s_answer_open_as_transformers_does(server, tiny_llama):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_llama))
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
    expected = list(hf.apply_chat_template(messages, continue_final_message=True, tokenize=True, return_dict=False))
    tokens = httpx.post(server[0] + "/tokenize", json={"model": MODEL, "messages": messages,
                                                       "continue_final_message": True}).json()
    assert tokens["tokens"] == expected
    reply = httpx.post(server[0] + "/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "continue_final_message": True, "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(expected)
    opened = httpx.post(server[0] + "/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert opened["count"] > len(expected)  # by default a new assistant turn is opened after the answer
    for extra, param in (({"add_generation_prompt": True}, "messages"), ({"echo": True}, "echo"),
                         ({"chat_template": "{{ messages }}"}, "chat_template")):
        refused = httpx.post(server[0] + "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "continue_final_message": True, "max_tokens": 2, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
