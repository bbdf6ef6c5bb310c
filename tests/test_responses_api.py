"""OpenAI's Responses API (`POST /v1/responses`): the request taken as the chat request it amounts to, the answer
shaped as output items (reasoning, message, function calls), whole or as the stream of events OpenAI's client
reads; what cannot be done (stored responses) is refused by name."""

import json

import httpx
import openai
import pytest

from kvstrata.server.responses_output import ResponseEvents, ResponseShaper
from kvstrata.server.responses_protocol import ResponsesRequest
from tests.server_harness import running_server
from tests.test_tool_calls import WEATHER

FUNCTIONS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]


def test_the_request_is_the_chat_request_it_amounts_to():
    request = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.5, "tools": FUNCTIONS,
        "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        "input": [
            {"role": "user", "content": "Weather in Bath?"},  # OpenAI's "easy" message: no type
            {"type": "reasoning", "id": "rs_1", "summary": []},  # earlier thinking: dropped
            {"role": "assistant", "content": "Checking."},  # a turn's text and its call: one assistant message
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Bath"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "Rain"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain."}]},
        ]})
    chat = request.chat_request()
    assert [m.plain() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Bath?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bath"}}}]},
        {"role": "tool", "content": "Rain", "tool_call_id": "c1"}, {"role": "assistant", "content": "Rain."}]
    assert (chat.max_completion_tokens, chat.temperature, chat.parallel_tool_calls) == (20, 0.5, False)
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == "get_weather"
    assert chat.response_format.json_schema.schema_ == WEATHER


def test_a_finished_chat_message_becomes_output_items():
    shaper = ResponseShaper(ResponsesRequest(model="m", input="hi"), "m", None)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    chat = {"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "reasoning_content": "Think.", "content": "Let me look.", "tool_calls": [call]}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                      "prompt_tokens_details": {"cached_tokens": 4}}}
    response = shaper.full(chat)
    assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "Think."}]
    assert response["output"][1]["content"][0]["text"] == "Let me look."
    assert {k: response["output"][2][k] for k in ("call_id", "name", "arguments")} == {
        "call_id": "call_1", "name": "get_time", "arguments": "{}"}
    assert response["status"] == "completed" and response["usage"]["input_tokens_details"] == {"cached_tokens": 4}


def test_the_chat_stream_s_deltas_become_events_that_open_fill_and_close_each_item():
    events = ResponseEvents(ResponseShaper(ResponsesRequest(model="m", input="hi"), "m", None))
    stream = events.start()
    for delta in ({"reasoning_content": "Hm"}, {"reasoning_content": "m."}, {"content": "Sunny"},
                  {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "get_time", "arguments": "{"}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}):
        stream += events.delta(delta)
    stream += events.finish("length", {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                                       "prompt_tokens_details": {"cached_tokens": 0}})
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    assert [e["type"].removeprefix("response.") for e in stream] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done", "incomplete"]
    final = stream[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hmm." and final["output"][2]["arguments"] == "{}"
    assert [e["output_index"] for e in stream if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_the_server_answers_as_its_chat_endpoint_does_whole_and_streamed(tiny_llama):
    with running_server(str(tiny_llama), kv_cache_memory="8MiB") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = {"model": "test-model", "max_output_tokens": 6, "temperature": 0}
        chat = client.chat.completions.create(model="test-model", max_completion_tokens=6, temperature=0,
                                              messages=[{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "hi"}])
        whole = client.responses.create(**ask, instructions="Be brief.", input="hi")
        assert whole.output_text == chat.choices[0].message.content and whole.status == "incomplete"
        assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.usage.output_tokens == 6
        assert (whole.temperature, whole.top_p, whole.tool_choice) == (0.0, 1.0, "auto")  # what it sampled with
        events = list(client.responses.create(**ask, instructions="Be brief.", input="hi", stream=True))
        assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert streamed == events[-1].response.output_text == whole.output_text


@pytest.mark.parametrize("extra, status, param", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"background": True}, 400, "background"),
    ({"max_output_tokens": 10_000}, 400, "max_output_tokens"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, 400, "tools.0.name"),
    ({"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice"),
    ({"input": [{"type": "image", "url": "x"}]}, 400, "input.0"),
    ({"text": {"format": {"type": "json_schema", "name": "w"}}}, 400, "text.format"),
    ({"model": "other"}, 404, "model"),
])
def test_what_cannot_be_done_is_refused_by_name(tiny_llama, extra, status, param):
    with running_server(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256) as (url, _):
        reply = httpx.post(url + "/v1/responses", json={"model": "test-model", "input": "hi", **extra}, timeout=60)
        assert reply.status_code == status and reply.json()["error"]["param"] == param


@pytest.mark.real_model
def test_a_named_function_s_call_comes_back_as_a_function_call_item():
    with running_server(None, kv_cache_memory="64MiB", max_model_len=1024) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = {"model": "test-model", "input": "What is the weather in Paris?", "tools": FUNCTIONS,
               "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40, "temperature": 0}
        (call,) = client.responses.create(**ask).output
        assert call.type == "function_call" and call.name == "get_weather"
        assert set(json.loads(call.arguments)) == {"city", "unit"}
        events = list(client.responses.create(**ask, stream=True))
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert arguments == call.arguments and events[-1].response.output[0].arguments == call.arguments
