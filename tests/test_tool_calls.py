"""Chat's tool calls where tool_choice asks for them (a named function, or "required"): the arguments held to
their schema by structured output and handed back as OpenAI's tool_calls, whole or streamed; the tools rendered by
the chat template; what the engine cannot do ("auto") refused."""

import json

import httpx
import jsonschema
import openai
import pytest

from kvstrata.model.tokenizer import Tokenizer
from kvstrata.server.tool_calls import ToolCalls
from tests.server_harness import running_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]


def test_a_named_call_hands_back_the_text_as_its_arguments():
    message, finish = ToolCalls("get_weather").message('{"city": "Bath", "unit": "celsius"}', "stop")
    assert message["content"] is None and finish == "stop"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Bath", "unit": "celsius"}'}


def test_required_calls_are_parsed_into_calls_and_text_cut_short_stays_text():
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Bath", ' \
           '"unit": "celsius"}}]'
    jsonschema.validate(json.loads(text), ToolCalls(None).schema({"get_time": None, "get_weather": WEATHER}))
    message, finish = ToolCalls(None).message(text, "stop")
    assert finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_time", {}), ("get_weather", {"city": "Bath", "unit": "celsius"})]
    message, finish = ToolCalls(None).message(text[:30], "length")
    assert message == {"role": "assistant", "content": text[:30]} and finish == "length"


def test_the_required_schema_takes_only_the_tools_with_their_arguments():
    schema = ToolCalls(None).schema({"get_time": None, "get_weather": WEATHER})
    for wrong in ([], [{"name": "get_date", "parameters": {}}], [{"name": "get_time", "parameters": {"x": 1}}],
                  [{"name": "get_weather", "parameters": {"city": "Bath"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_without_parallel_calls_required_is_held_to_one_call():
    schema = ToolCalls(None, parallel=False).schema({"get_time": None})
    call = {"name": "get_time", "parameters": {}}
    jsonschema.validate([call], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], schema)


def test_a_named_call_streams_its_arguments_after_its_id_and_name():
    calls = ToolCalls("get_weather")
    first, _ = calls.chunk('{"city"', True, '{"city"', None)
    rest, finish = calls.chunk(': "Bath"}', False, '{"city": "Bath"}', "stop")
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert first["tool_calls"][0]["index"] == 0 and first["tool_calls"][0]["id"].startswith("call_")
    assert rest == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Bath"}'}}]} and finish == "stop"


def test_required_calls_come_whole_in_the_last_chunk():
    calls = ToolCalls(None)
    assert calls.chunk("[{", True, "[{", None) == ({}, None)
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]'
    delta, finish = calls.chunk("}]", True, text, "stop")
    assert finish == "tool_calls" and [call["index"] for call in delta["tool_calls"]] == [0, 1]
    assert calls.chunk("", False, text[:9], "length") == ({"content": text[:9]}, "length")


def test_the_chat_template_is_given_the_tools(tiny_llama):
    tokenizer = Tokenizer.from_directory(tiny_llama)
    tokenizer = Tokenizer(tokenizer.backend, {"eos_token": "<|im_end|>"},
                          "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}"
                          "{% for m in messages %}{{ m.content }}{% endfor %}")
    with_tools = tokenizer.decode(tokenizer.encode_chat([{"role": "user", "content": "hi"}], tools=TOOLS))
    assert with_tools.replace(" ", "") == "get_weather;get_time;hi"
    assert tokenizer.decode(tokenizer.encode_chat([{"role": "user", "content": "hi"}])).strip() == "hi"


@pytest.fixture(scope="module")
def tiny_server(tiny_llama):
    with running_server(str(tiny_llama), "test-model", kv_cache_memory="8MiB") as (url, _):
        yield url


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS}, "tool_choice"),  # auto, the default: no parser for the model's own call format
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "none"},
     "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tools"),  # the tiny tokenizer has no "[" or "{"
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "none"}, "tools"),  # a name defined twice
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "stop": ["}"]}, "stop"),
    ({"tools": TOOLS, "tool_choice": "required", "continue_final_message": True, "add_generation_prompt": False,
      "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "[{"}]},
     "continue_final_message"),
])
def test_tool_requests_the_engine_cannot_serve_are_refused(tiny_server, fields, param):
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    reply = httpx.post(tiny_server + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_conversation_with_earlier_calls_and_their_answers_is_taken(tiny_server):
    messages = [{"role": "user", "content": "Weather in Bath?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Bath", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "11 degrees, rain"}]
    body = {"model": "test-model", "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    reply = httpx.post(tiny_server + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
    tokenized = httpx.post(tiny_server + "/tokenize", json={"model": "test-model", "messages": messages,
                                                             "tools": TOOLS}, timeout=60)
    assert tokenized.status_code == 200 and tokenized.json()["count"] == reply.json()["usage"]["prompt_tokens"]



@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "tool_call_id": "call_1"}, "messages.0"),  # no content
    ({"role": "tool", "content": "11 degrees"}, "messages.0"),  # which call it answers
    ({"role": "assistant"}, "messages.0"),  # neither content nor calls
    ({"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}, "messages.0"),
    ({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "now"}}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "[" * 100_000}}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_malformed_messages_of_a_tool_conversation_are_refused(tiny_server, message, param):
    body = {"model": "test-model", "messages": [message], "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    reply = httpx.post(tiny_server + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.real_model
def test_the_default_model_calls_the_function_asked_for_through_openai_s_client():
    with running_server(None, "test-model", kv_cache_memory="64MiB", max_model_len=1024) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = {"model": "test-model", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
               "tools": TOOLS, "max_tokens": 60, "temperature": 0}
        named = client.chat.completions.create(
            **ask, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (call,) = named.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        streamed = client.chat.completions.create(
            **ask, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
        pieces = [d.tool_calls[0] for chunk in streamed for d in [chunk.choices[0].delta] if d.tool_calls]
        assert pieces[0].function.name == "get_weather" and pieces[0].id
        assert "".join(p.function.arguments for p in pieces) == call.function.arguments
        required = client.chat.completions.create(**ask, tool_choice="required")
        assert required.choices[0].finish_reason == "tool_calls"
        for call in required.choices[0].message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        streamed = list(client.chat.completions.create(**ask, tool_choice="required", stream=True, n=2))
        for index in (0, 1):
            deltas = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == index]
            calls = [call for d in deltas if d.delta.tool_calls for call in d.delta.tool_calls]
            assert [(c.function.name, c.function.arguments) for c in calls] == [
                (c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls]
            assert deltas[-1].finish_reason == "tool_calls"
        cut = client.chat.completions.create(**{**ask, "max_tokens": 5}, tool_choice="required")
        assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
        assert cut.choices[0].message.content.startswith("[")
